//! Agent tunnels on the broker side: the [`TunnelActor`] owns one registered tunnel for its
//! lifetime. It registers the [`TunnelHandle`] with the registry, watches the connection and its
//! keepalive (tasks of the broker's drain), and deregisters when either ends. Front ends open
//! streams through the handle directly; bytes never pass through an actor. The handshake that
//! creates it is in `accept`.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tether_tunnel::keepalive::WindowSampling;
use tether_tunnel::watchdog::Watchdog;

use crate::handle::TunnelHandle;
use crate::registry::{Deregister, Register, Registry};
/// Owns one registered tunnel for its lifetime.
pub struct TunnelActor {
    pub(crate) handle: Arc<TunnelHandle>,
    pub(crate) registry: Addr<Registry>,
    pub(crate) keepalive: Option<(h2::PingPong, Duration, Duration)>,
    pub(crate) sampling: Option<WindowSampling>,
    pub(crate) closed: Option<tokio::sync::oneshot::Receiver<String>>,
    pub(crate) tasks: tether_runtime::Drain,
    pub(crate) watchdog: Watchdog,
    /// `tether_broker_tunnel_wedged_total{detector}`.
    pub(crate) wedged: prometheus::IntCounterVec,
}

#[derive(Message)]
#[rtype(result = "()")]
struct Ended(String);

impl Actor for TunnelActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.registry.do_send(Register(Arc::clone(&self.handle)));
        let (pp, interval, timeout) = self.keepalive.take().expect("started once");
        let closed = self.closed.take().expect("started once");
        let sampling = self.sampling.take();
        let me = ctx.address();
        let cluster = self.handle.cluster.clone();
        let id = self.handle.id;
        let handle = Arc::clone(&self.handle);
        let watchdog = self.watchdog.clone();
        let wedged = self.wedged.clone();
        self.tasks.spawn("tunnel watcher", async move {
            let progress = Arc::clone(&watchdog.progress);
            let keepalive = tether_tunnel::keepalive::run_probed(
                pp,
                interval,
                timeout,
                handle.rtt_cell(),
                sampling,
                Some(&progress),
            );
            let reason = tokio::select! {
                r = closed => r.unwrap_or_else(|_| "connection task ended".into()),
                e = keepalive => {
                    if matches!(e, tether_tunnel::keepalive::KeepaliveError::Timeout(_)) {
                        wedged.with_label_values(&["keepalive"]).inc();
                        tracing::warn!(%cluster, tunnel = id, reason = %e, "tunnel wedged: tearing it down");
                    }
                    handle.close();
                    e.to_string()
                }
                w = watchdog.run() => {
                    wedged.with_label_values(&["watchdog"]).inc();
                    tracing::warn!(%cluster, tunnel = id, reason = %w, "tunnel wedged: tearing it down");
                    // Drop the connection: its streams end with an error now, not when TCP
                    // finally gives up; the agent's own watchdog redials.
                    handle.close();
                    w.to_string()
                }
            };
            tracing::info!(%cluster, tunnel = id, %reason, "tunnel connection ended");
            me.do_send(Ended(reason));
        });
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.registry.do_send(Deregister {
            cluster: self.handle.cluster.clone(),
            tunnel_id: self.handle.id,
        });
    }
}

impl Handler<Ended> for TunnelActor {
    type Result = ();
    fn handle(&mut self, msg: Ended, ctx: &mut Context<Self>) {
        tracing::debug!(cluster = %self.handle.cluster, tunnel = self.handle.id, reason = %msg.0, "stopping tunnel actor");
        ctx.stop();
    }
}
