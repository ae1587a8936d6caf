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

/// Decides an auth request. `Err` carries the reason for the refusal.
pub async fn authorize(ctx: &HubCtx, req: &AuthRequestBody) -> Result<Grant, String> {
    let opts = &req.connect_opts;
    let conn_id = connection_id_from_name(&opts.name).ok_or_else(|| {
        format!(
            "client name {:?} is not tether/<role>/<connection id>",
            opts.name
        )
    })?;
    let now = SystemTime::now();
    if !opts.auth_token.is_empty() {
        let token = BootstrapToken::parse(&opts.auth_token).map_err(|e| e.to_string())?;
        let rec = ctx
            .token(&token.id)
            .await
            .map_err(|e| format!("token lookup failed: {e}"))?
            .ok_or_else(|| format!("unknown bootstrap token {}", token.id))?;
        if rec.secret_sha256 != token.secret_sha256() {
            return Err(format!(
                "unknown bootstrap token {} (secret does not match)",
                token.id
            ));
        }
        let expires = parse_rfc3339(&rec.expires)
            .ok_or_else(|| format!("bootstrap token {} has no valid expiry", token.id))?;
        if now >= expires {
            return Err(format!(
                "bootstrap token {} expired at {}",
                token.id, rec.expires
            ));
        }
        return Ok(Grant {
            display_name: format!("bootstrap:{}", token.id),
            permissions: Permissions::bootstrap(conn_id),
            expires: Some(expires),
        });
    }
    if CertCredential::looks_like(&opts.pass) {
        let cred = CertCredential::parse(&opts.pass).map_err(|e| e.to_string())?;
        tether_pki::verify_issued_by(&cred.cert_der, ctx.ca.cert_pem(), now)
            .map_err(|e| format!("client certificate refused: {e}"))?;
        let info = tether_pki::CertInfo::from_der(&cred.cert_der).map_err(|e| e.to_string())?;
        let (cluster, _agent) = subject::parse_common_name(&info.common_name).ok_or_else(|| {
            format!(
                "certificate CN {:?} is not an OCM agent identity",
                info.common_name
            )
        })?;
        if opts.user != info.common_name {
            return Err(format!(
                "user {:?} does not match certificate CN {:?}",
                opts.user, info.common_name
            ));
        }
        cred.verify_possession(&opts.user, &info.public_key_raw, now)?;
        let mc = ctx
            .cluster(cluster)
            .await
            .map_err(|e| format!("cluster lookup failed: {e}"))?
            .ok_or_else(|| format!("cluster {cluster} is not registered"))?;
        if !mc.spec.hub_accepts_client {
            return Err(format!("cluster {cluster} is not accepted by the hub"));
        }
        if let Some(rb) = mc
            .metadata
            .annotations
            .get(REVOKED_BEFORE_ANNOTATION)
            .and_then(|s| parse_rfc3339(s))
            && info.issued_at() < rb
        {
            return Err(format!(
                "certificate of cluster {cluster} was revoked (issued before the cluster was denied)"
            ));
        }
        return Ok(Grant {
            display_name: info.common_name.clone(),
            permissions: Permissions::cluster(cluster, conn_id),
            expires: Some(info.not_after),
        });
    }
    Err("no bootstrap token or cluster certificate credential presented".into())
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
            ctx.issuer.deny(&req, &reason)
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
