//! The one place the hub's certificate authority does its CPU work — signing a cluster's CSR,
//! an add-on agent's CSR, issuing a hub client's certificate — whichever way the request
//! arrived (registration subjects, add-on delivery, `tetherctl client create`, `tetherctl
//! accept`): a thread of tokio's blocking pool, so an RSA/ECDSA signature never stalls the
//! async workers serving other requests.

use std::sync::Arc;

use tether_pki::HubCa;

/// Runs `f` with the hub CA on the blocking pool and returns its result (a panic in `f` is
/// resumed here).
pub async fn with_ca<R, F>(ca: &Arc<HubCa>, f: F) -> R
where
    F: FnOnce(&HubCa) -> R + Send + 'static,
    R: Send + 'static,
{
    let ca = Arc::clone(ca);
    match tokio::task::spawn_blocking(move || f(&ca)).await {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}
