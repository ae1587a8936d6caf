//! The registration controller's NATS adapter: the subscription pumps that serve the
//! registration subjects, and the periodic lease monitor and CSR garbage collector.
//!
//! There is no actor here: the state (KV, the lease table, pending CSRs) belongs to
//! [`crate::registration::Registration`], whose writes are compare-and-swap on the KV revision,
//! so requests of different clusters run concurrently and two hub replicas never lose each
//! other's updates. One pump task per subscription serves at most [`MAX_INFLIGHT_PER_SUBJECT`]
//! requests at a time, so a slow store slows the pumps rather than growing queues. CSR signing
//! runs on the blocking pool ([`crate::signing`]) whichever subject the request came on.
//!
//! With several hub replicas every replica serves requests (queue groups), but only the leader
//! ([`tether_control::leader`], controller `registration`) runs the lease monitor and the CSR
//! garbage collector ([`run_periodic`]): one loop each, so two checks never overlap.

use std::sync::Arc;

use tether_control::resources::{AdminClusterRequest, CsrGet, CsrSubmit, LeaseRenew};
use tether_control::subjects;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::hub::HubCtx;
use crate::serve::Answer;

/// Concurrent requests in flight per subscription.
pub const MAX_INFLIGHT_PER_SUBJECT: usize = 64;
/// How often finished CSRs are garbage-collected, and how long they are kept.
pub const CSR_GC_INTERVAL: std::time::Duration = std::time::Duration::from_secs(300);
pub const CSR_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);
/// Queue group so several hub replicas share the work.
pub const QUEUE_GROUP: &str = "tether-registration";

/// What a message on one of the controller's subjects asks for.
#[derive(Debug)]
pub enum Request {
    SubmitCsr {
        cluster: String,
        body: CsrSubmit,
        renewal: bool,
        trace_id: Option<String>,
    },
    GetCsr {
        cluster: String,
        body: CsrGet,
        renewal: bool,
    },
    Lease {
        cluster: String,
        body: LeaseRenew,
    },
    Accept(AdminClusterRequest),
    Deny(AdminClusterRequest),
    /// A raw auth-callout request JWT.
    Callout(bytes::Bytes),
}

/// Runs the leader-only periodic controllers until `shutdown`: the lease monitor every
/// `policy.lease_check_interval` (on becoming leader it first restarts every lease's grace
/// period, [`crate::registration::Registration::restart_lease_grace`]) and the CSR garbage
/// collector every [`CSR_GC_INTERVAL`]. A replica that does not lead skips the ticks.
pub async fn run_periodic(
    hub: Arc<HubCtx>,
    leader: watch::Receiver<bool>,
    shutdown: CancellationToken,
) {
    let leads = |l: &watch::Receiver<bool>| *l.borrow();
    let lease_monitor = async {
        let mut tick = every(hub.policy.lease_check_interval);
        let mut was_leading = false;
        while next_tick(&mut tick, &shutdown).await {
            let leading = leads(&leader);
            if leading && !was_leading {
                hub.restart_lease_grace();
            }
            was_leading = leading;
            if leading && let Err(e) = hub.check_leases().await {
                tracing::warn!(error = %e, "lease check failed");
            }
        }
    };
    let csr_gc = async {
        let mut tick = every(CSR_GC_INTERVAL);
        while next_tick(&mut tick, &shutdown).await {
            if !leads(&leader) {
                continue;
            }
            match hub.gc_csrs(CSR_RETENTION).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "garbage-collected old CSRs"),
                Err(e) => tracing::warn!(error = %e, "CSR garbage collection failed"),
            }
        }
    };
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = futures::future::join(lease_monitor, csr_gc) => {}
    }
}

/// An interval whose first tick is one `period` from now; a late tick is delayed, not burst.
fn every(period: std::time::Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval_at(Instant::now() + period, period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick
}

/// Waits for the next tick; false once `stop` is cancelled.
async fn next_tick(tick: &mut tokio::time::Interval, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tick.tick() => true,
    }
}

fn json<T: serde::Serialize>(r: Result<T, crate::hub::HubError>) -> Answer {
    let body = serde_json::to_vec(&r.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    Ok(Some(body.into()))
}

/// Serves one request.
async fn handle(hub: &HubCtx, req: Request) -> Answer {
    match req {
        Request::SubmitCsr {
            cluster,
            body,
            renewal,
            trace_id,
        } => json(hub.submit_csr(&cluster, body, renewal, trace_id).await),
        Request::GetCsr {
            cluster,
            body,
            renewal,
        } => json(hub.get_csr(&cluster, &body.csr_name, renewal).await),
        Request::Lease { cluster, body } => json(hub.renew_lease(&cluster, body).await),
        Request::Accept(r) => json(hub.accept(r).await),
        Request::Deny(r) => json(hub.deny(r).await),
        Request::Callout(raw) => Ok(crate::callout::respond(hub, &raw).await.map(Into::into)),
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    BootstrapCsr,
    BootstrapCsrGet,
    ClusterCsr,
    ClusterCsrGet,
    Lease,
    Accept,
    Deny,
    Callout,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::BootstrapCsr => "bootstrap.csr",
            Kind::BootstrapCsrGet => "bootstrap.csr.get",
            Kind::ClusterCsr => "cluster.csr",
            Kind::ClusterCsrGet => "cluster.csr.get",
            Kind::Lease => "cluster.lease",
            Kind::Accept => "admin.accept",
            Kind::Deny => "admin.deny",
            Kind::Callout => "auth.callout",
        }
    }
}

/// Why a registration request could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("subject {0} names no cluster")]
    NoCluster(String),
    #[error("malformed {what} body: {source}")]
    Malformed {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

fn parse(kind: Kind, msg: &async_nats::Message) -> Result<Request, ParseError> {
    let subject = msg.subject.as_str();
    let cluster = || {
        subjects::cluster_of(subject)
            .map(str::to_string)
            .ok_or_else(|| ParseError::NoCluster(subject.to_owned()))
    };
    fn body<T: serde::de::DeserializeOwned>(
        msg: &async_nats::Message,
        what: &'static str,
    ) -> Result<T, ParseError> {
        serde_json::from_slice(&msg.payload)
            .map_err(|source| ParseError::Malformed { what, source })
    }
    let trace_id = tether_control::trace::extract(msg.headers.as_ref()).map(|t| t.trace_id);
    Ok(match kind {
        Kind::BootstrapCsr | Kind::ClusterCsr => Request::SubmitCsr {
            cluster: cluster()?,
            body: body(msg, "CSR")?,
            renewal: matches!(kind, Kind::ClusterCsr),
            trace_id,
        },
        Kind::BootstrapCsrGet | Kind::ClusterCsrGet => Request::GetCsr {
            cluster: cluster()?,
            body: body(msg, "CSR get")?,
            renewal: matches!(kind, Kind::ClusterCsrGet),
        },
        Kind::Lease => Request::Lease {
            cluster: cluster()?,
            body: body(msg, "lease")?,
        },
        Kind::Accept => Request::Accept(body(msg, "accept")?),
        Kind::Deny => Request::Deny(body(msg, "deny")?),
        Kind::Callout => Request::Callout(msg.payload.clone()),
    })
}

/// Subscribes to every controller subject and serves its requests
/// ([`crate::serve::serve_subjects`]).
pub async fn start_pumps(
    client: async_nats::Client,
    hub: Arc<HubCtx>,
    shutdown: CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, crate::ManagerError> {
    let table = [
        (subjects::BOOTSTRAP_CSR_ALL, Kind::BootstrapCsr),
        (subjects::BOOTSTRAP_CSR_GET_ALL, Kind::BootstrapCsrGet),
        (subjects::CLUSTER_CSR_ALL, Kind::ClusterCsr),
        (subjects::CLUSTER_CSR_GET_ALL, Kind::ClusterCsrGet),
        (subjects::CLUSTER_LEASE_ALL, Kind::Lease),
        (subjects::ADMIN_ACCEPT, Kind::Accept),
        (subjects::ADMIN_DENY, Kind::Deny),
        (subjects::AUTH_CALLOUT, Kind::Callout),
    ];
    crate::serve::serve_subjects(
        &client,
        QUEUE_GROUP,
        table,
        MAX_INFLIGHT_PER_SUBJECT,
        "registration",
        &shutdown,
        move |kind, msg| {
            let hub = Arc::clone(&hub);
            async move {
                let span = tracing::info_span!(
                    "registration.request",
                    subject = %msg.subject,
                    kind = kind.label(),
                );
                tether_control::trace::set_parent(&span, msg.headers.as_ref());
                match parse(kind, &msg) {
                    Ok(req) => tracing::Instrument::instrument(handle(&hub, req), span).await,
                    Err(e) => Err(e.to_string()),
                }
            }
        },
    )
    .await
}
