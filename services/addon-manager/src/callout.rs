//! NATS auth callout: decides who may connect and with which permissions.
//!
//! - bootstrap token → may only register (`tether.v1.bootstrap.*.csr[.get]`), until the token
//!   expires;
//! - cluster certificate credential → only `tether.v1.cluster.<its cluster>.>`, until the
//!   certificate expires, and only while the cluster is accepted and the certificate is newer
//!   than the last deny;
//! - anything else is refused with a reason (logged on the hub; the client sees
//!   "authorization violation").

use std::time::SystemTime;

use tether_control::auth::{
    AuthRequestBody, BootstrapToken, CertCredential, Permissions, connection_id_from_name,
};
use tether_control::resources::parse_rfc3339;
use tether_pki::subject;

use crate::hub::{HubCtx, REVOKED_BEFORE_ANNOTATION};

/// A positive decision.
#[derive(Debug)]
pub struct Grant {
    pub display_name: String,
    pub permissions: Permissions,
    pub expires: Option<SystemTime>,
}

/// Which kind of credential a request carried (metric label).
pub fn credential_kind(req: &AuthRequestBody) -> &'static str {
    if !req.connect_opts.auth_token.is_empty() {
        "bootstrap_token"
    } else if CertCredential::looks_like(&req.connect_opts.pass) {
        "certificate"
    } else {
        "other"
    }
}

/// Why the auth callout refused a connection (the reason goes back to NATS and the log).
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("client name {0:?} is not tether/<role>/<connection id>")]
    ClientName(String),
    #[error(transparent)]
    Credential(#[from] tether_control::auth::AuthError),
    #[error("token lookup failed: {0}")]
    TokenLookup(#[source] crate::hub::HubError),
    #[error("unknown bootstrap token {0}")]
    UnknownToken(String),
    #[error("unknown bootstrap token {0} (secret does not match)")]
    TokenSecret(String),
    #[error("bootstrap token {0} has no valid expiry")]
    TokenExpiry(String),
    #[error("bootstrap token {id} expired at {at}")]
    TokenExpired { id: String, at: String },
    #[error("client certificate refused: {0}")]
    NotIssuedByHub(#[source] tether_pki::PkiError),
    #[error(transparent)]
    Certificate(tether_pki::PkiError),
    #[error("certificate CN {0:?} is not an OCM agent identity")]
    NotAnAgent(String),
    #[error("user {user:?} does not match certificate CN {cn:?}")]
    UserMismatch { user: String, cn: String },
    #[error("cluster lookup failed: {0}")]
    ClusterLookup(#[source] crate::hub::HubError),
    #[error("cluster {0} is not registered")]
    NotRegistered(String),
    #[error("cluster {0} is not accepted by the hub")]
    NotAccepted(String),
    #[error("certificate of cluster {0} was revoked (issued before the cluster was denied)")]
    Revoked(String),
    #[error("no bootstrap token or cluster certificate credential presented")]
    NoCredential,
}

/// Decides an auth request. `Err` carries the reason for the refusal.
pub async fn authorize(ctx: &HubCtx, req: &AuthRequestBody) -> Result<Grant, Refusal> {
    let opts = &req.connect_opts;
    let conn_id = connection_id_from_name(&opts.name)
        .ok_or_else(|| Refusal::ClientName(opts.name.clone()))?;
    let now = SystemTime::now();
    if !opts.auth_token.is_empty() {
        let token = BootstrapToken::parse(&opts.auth_token)?;
        let rec = ctx
            .token(&token.id)
            .await
            .map_err(Refusal::TokenLookup)?
            .ok_or_else(|| Refusal::UnknownToken(token.id.clone()))?;
        if rec.secret_sha256 != token.secret_sha256() {
            return Err(Refusal::TokenSecret(token.id));
        }
        let expires =
            parse_rfc3339(&rec.expires).ok_or_else(|| Refusal::TokenExpiry(token.id.clone()))?;
        if now >= expires {
            return Err(Refusal::TokenExpired {
                id: token.id,
                at: rec.expires,
            });
        }
        return Ok(Grant {
            display_name: format!("bootstrap:{}", token.id),
            permissions: Permissions::bootstrap(conn_id),
            expires: Some(expires),
        });
    }
    if CertCredential::looks_like(&opts.pass) {
        let cred = CertCredential::parse(&opts.pass)?;
        tether_pki::verify_issued_by(&cred.cert_der, ctx.ca.cert_pem(), now)
            .map_err(Refusal::NotIssuedByHub)?;
        let info = tether_pki::CertInfo::from_der(&cred.cert_der).map_err(Refusal::Certificate)?;
        let (cluster, _agent) = subject::parse_common_name(&info.common_name)
            .ok_or_else(|| Refusal::NotAnAgent(info.common_name.clone()))?;
        if opts.user != info.common_name {
            return Err(Refusal::UserMismatch {
                user: opts.user.clone(),
                cn: info.common_name.clone(),
            });
        }
        cred.verify_possession(&opts.user, &info.public_key_raw, now)?;
        let mc = ctx
            .cluster(cluster)
            .await
            .map_err(Refusal::ClusterLookup)?
            .ok_or_else(|| Refusal::NotRegistered(cluster.to_owned()))?;
        if !mc.spec.hub_accepts_client {
            return Err(Refusal::NotAccepted(cluster.to_owned()));
        }
        if let Some(rb) = mc
            .metadata
            .annotations
            .get(REVOKED_BEFORE_ANNOTATION)
            .and_then(|s| parse_rfc3339(s))
            && info.issued_at() < rb
        {
            return Err(Refusal::Revoked(cluster.to_owned()));
        }
        return Ok(Grant {
            display_name: info.common_name.clone(),
            permissions: Permissions::cluster(cluster, conn_id),
            expires: Some(info.not_after),
        });
    }
    Err(Refusal::NoCredential)
}

/// Builds the signed response JWT for a raw callout request.
pub async fn respond(ctx: &HubCtx, request_jwt: &[u8]) -> Option<String> {
    let started = std::time::Instant::now();
    let text = std::str::from_utf8(request_jwt).ok()?;
    let req = match tether_control::auth::decode_auth_request(text) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "ignoring invalid auth callout request");
            return None;
        }
    };
    let kind = credential_kind(&req);
    let decision = authorize(ctx, &req).await;
    ctx.metrics
        .auth_callout_duration_seconds
        .with_label_values(&[kind])
        .observe(started.elapsed().as_secs_f64());
    let out = match decision {
        Ok(grant) => {
            ctx.metrics
                .auth_callout_total
                .with_label_values(&[kind, "allowed"])
                .inc();
            tracing::debug!(user = %grant.display_name, host = %req.client_info.host, "connection allowed");
            ctx.issuer
                .allow(&req, &grant.display_name, &grant.permissions, grant.expires)
        }
        Err(reason) => {
            ctx.metrics
                .auth_callout_total
                .with_label_values(&[kind, "refused"])
                .inc();
            tracing::warn!(
                credential = kind,
                user = %req.connect_opts.user,
                host = %req.client_info.host,
                %reason,
                "connection refused"
            );
            ctx.issuer.deny(&req, &reason.to_string())
        }
    };
    match out {
        Ok(jwt) => Some(jwt),
        Err(e) => {
            tracing::error!(error = %e, "cannot sign auth callout response");
            None
        }
    }
}
