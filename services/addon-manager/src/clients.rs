//! Hub client credentials: `tether.v1.admin.client.create|delete` (queue group
//! [`QUEUE_GROUP`], hub/admin users only — non-hub NATS users have no rights on `admin.*`).
//!
//! - create, `credential: token`: a fresh random token; the HubClient stores only its SHA-256
//!   and the token goes back in the reply, once.
//! - create, `credential: certificate`: a fresh ECDSA P-256 key and a certificate with CN
//!   `tether:client:<name>` (client-auth usage, back-dated for clock skew) signed by the hub CA;
//!   key and certificate go back in the reply, once; the HubClient keeps serial and expiry.
//! - delete: removes the HubClient; brokers stop accepting it for new streams as soon as they
//!   see the KV change.
//!
//! Every change is an event (`Created` / `Deleted` on kind HubClient).

use std::sync::Arc;
use std::time::Duration;

use tether_control::clients::{
    CLIENT_CN_PREFIX, ClientCreateReply, ClientCreateRequest, ClientDeleteReply,
    ClientDeleteRequest, DEFAULT_CERT_LIFETIME_SECONDS, HubClient, HubClientSpec,
    IssuedCertificate, new_token, token_sha256, validate_client_name,
};
use tether_control::resources::{Event, rfc3339};
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};
use tether_control::subjects;
use tokio_util::sync::CancellationToken;

/// Queue group of the client-credential subjects.
pub const QUEUE_GROUP: &str = "tether-clients";
/// Concurrent requests in flight per subject.
pub const MAX_INFLIGHT_CLIENT_REQUESTS: usize = 16;
/// Shortest certificate lifetime accepted.
pub const MIN_CERT_LIFETIME: Duration = Duration::from_secs(60);

/// Why a client-credential request was refused (the message goes back to the caller).
#[derive(Debug, thiserror::Error)]
pub enum ClientsError {
    #[error(transparent)]
    Field(#[from] tether_control::addons::FieldError),
    #[error("certLifetimeSeconds: must be at least {}", MIN_CERT_LIFETIME.as_secs())]
    LifetimeTooShort,
    #[error("credential: {0:?} is not one of token, certificate")]
    Credential(String),
    #[error("hub client {0} already exists (delete it first to issue a new credential)")]
    Exists(String),
    #[error("hub client {0} not found")]
    NotFound(String),
    #[error("issuing the client certificate: {0}")]
    Issue(#[source] tether_pki::PkiError),
    #[error("malformed client {what} body: {source}")]
    Malformed {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("encoding the reply: {0}")]
    Encode(#[source] serde_json::Error),
    #[error(transparent)]
    Store(#[from] tether_control::ControlError),
}

/// What the handlers need.
pub struct ClientsCtx {
    pub store: HubStore,
    pub ca: Arc<tether_pki::HubCa>,
}

/// Issues a client certificate from the hub CA: (cert PEM, key PEM, serial hex, notAfter).
fn issue_cert(
    ca: &tether_pki::HubCa,
    name: &str,
    lifetime: Duration,
) -> Result<(String, String, String, String), ClientsError> {
    let c = ca
        .issue_client(&format!("{CLIENT_CN_PREFIX}{name}"), lifetime)
        .map_err(ClientsError::Issue)?;
    Ok((c.cert_pem, c.key_pem, c.serial_hex, rfc3339(c.not_after)))
}

async fn event(store: &HubStore, reason: &str, name: &str, message: String) {
    let ev = Event::new("HubClient", name, "Normal", reason, &message);
    if let Err(e) = store.publish_event(&ev).await {
        tracing::warn!(error = %e, reason, "cannot publish event");
    }
}

/// Handles `tether.v1.admin.client.create`.
pub async fn create(
    ctx: &ClientsCtx,
    req: ClientCreateRequest,
) -> Result<ClientCreateReply, ClientsError> {
    validate_client_name("name", &req.name)?;
    let name = req.name.clone();
    let (spec, token, cert) = match req.credential.as_str() {
        "token" => {
            let t = new_token(&name);
            (
                HubClientSpec {
                    token_sha256: Some(token_sha256(&t)),
                    certificate: None,
                },
                Some(t),
                None,
            )
        }
        "certificate" => {
            let lifetime = Duration::from_secs(
                req.cert_lifetime_seconds
                    .unwrap_or(DEFAULT_CERT_LIFETIME_SECONDS),
            );
            if lifetime < MIN_CERT_LIFETIME {
                return Err(ClientsError::LifetimeTooShort);
            }
            let (pem, key, serial, not_after) = {
                let name = name.clone();
                crate::signing::with_ca(&ctx.ca, move |ca| issue_cert(ca, &name, lifetime)).await?
            };
            (
                HubClientSpec {
                    token_sha256: None,
                    certificate: Some(IssuedCertificate {
                        common_name: format!("{CLIENT_CN_PREFIX}{name}"),
                        serial,
                        not_after,
                    }),
                },
                None,
                Some((pem, key)),
            )
        }
        other => {
            return Err(ClientsError::Credential(other.to_owned()));
        }
    };
    let client = HubClient::new(&name, spec);
    match ctx.store.create(Bucket::HubClients, &name, &client).await {
        Ok(Some(_)) => {}
        Ok(None) => return Err(ClientsError::Exists(name)),
        Err(e) => return Err(e.into()),
    }
    tracing::info!(client = %name, credential = %req.credential, "hub client created");
    event(
        &ctx.store,
        "Created",
        &name,
        format!("hub client {name} created ({})", req.credential),
    )
    .await;
    let (certificate, key) = match cert {
        Some((c, k)) => (Some(c), Some(k)),
        None => (None, None),
    };
    Ok(ClientCreateReply {
        client,
        token,
        ca_bundle: certificate.as_ref().map(|_| ctx.ca.cert_pem().to_owned()),
        certificate,
        key,
    })
}

/// Handles `tether.v1.admin.client.delete`.
pub async fn delete(
    ctx: &ClientsCtx,
    req: ClientDeleteRequest,
) -> Result<ClientDeleteReply, ClientsError> {
    let exists = ctx
        .store
        .get::<HubClient>(Bucket::HubClients, &req.name)
        .await?
        .is_some();
    if !exists {
        return Err(ClientsError::NotFound(req.name));
    }
    ctx.store.delete(Bucket::HubClients, &req.name).await?;
    tracing::info!(client = %req.name, "hub client deleted");
    event(
        &ctx.store,
        "Deleted",
        &req.name,
        format!("hub client {} deleted: its credential is revoked", req.name),
    )
    .await;
    Ok(ClientDeleteReply { deleted: true })
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Create,
    Delete,
}

async fn serve(ctx: &ClientsCtx, kind: Kind, payload: &[u8]) -> Result<Vec<u8>, ClientsError> {
    let malformed = |what| move |source| ClientsError::Malformed { what, source };
    let out = match kind {
        Kind::Create => {
            let req: ClientCreateRequest =
                serde_json::from_slice(payload).map_err(malformed("create"))?;
            serde_json::to_vec(&create(ctx, req).await?)
        }
        Kind::Delete => {
            let req: ClientDeleteRequest =
                serde_json::from_slice(payload).map_err(malformed("delete"))?;
            serde_json::to_vec(&delete(ctx, req).await?)
        }
    };
    out.map_err(ClientsError::Encode)
}

/// Serves both subjects until `shutdown`. Returns the tasks.
pub async fn start(
    client: async_nats::Client,
    ctx: Arc<ClientsCtx>,
    shutdown: CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, crate::ManagerError> {
    crate::serve::serve_subjects(
        &client,
        QUEUE_GROUP,
        [
            (subjects::ADMIN_CLIENT_CREATE, Kind::Create),
            (subjects::ADMIN_CLIENT_DELETE, Kind::Delete),
        ],
        MAX_INFLIGHT_CLIENT_REQUESTS,
        "client",
        &shutdown,
        move |kind, msg| {
            let ctx = ctx.clone();
            async move {
                let span = tracing::info_span!("clients.request", subject = %msg.subject);
                tether_control::trace::set_parent(&span, msg.headers.as_ref());
                tracing::Instrument::instrument(serve(&ctx, kind, &msg.payload), span)
                    .await
                    .map(|b| Some(bytes::Bytes::from(b)))
                    .map_err(|e| e.to_string())
            }
        },
    )
    .await
}
