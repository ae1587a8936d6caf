//! Agent tunnels on the broker side: the [`TunnelActor`] owns one registered tunnel and its
//! connection for its lifetime.
//!
//! `accept` runs the handshake and spawns the task driving the HTTP/2 connection (a task of the
//! broker's drain, on the tokio pool); the actor takes that task as a [`Connection`], which
//! aborts it when dropped. The actor registers the [`TunnelHandle`] with the registry and watches
//! the connection task, the keepalive and the wedged-tunnel watchdog (futures of the actor's own
//! context). So the two lifetimes are one:
//! - the connection ends (closed, cut, wedged, or its task panics) → the actor stops;
//! - the actor stops or dies (even by a panic in a handler) → its context and the [`Connection`]
//!   are dropped, which aborts the connection task, and `Drop` deregisters the tunnel.
//!
//! The agent then redials and a new actor registers a new tunnel; other tunnels are untouched.
//! Front ends open streams through the handle directly; bytes never pass through an actor, and
//! each stream's byte pump is a task of its own with HTTP/2 flow control as backpressure.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tether_tunnel::keepalive::WindowSampling;
use tether_tunnel::watchdog::Watchdog;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::handle::TunnelHandle;
use crate::registry::{Deregister, Register, Registry};
use crate::test_hooks::{self, TestHooks};

/// The task driving a tunnel's connection (`tether-tunnel/2` or HTTP/2); it returns why the
/// connection ended.
/// Dropping it aborts the task (the connection is dropped, its streams reset).
pub type Connection = AbortOnDropHandle<String>;

/// Owns one registered tunnel and its connection for its lifetime.
pub struct TunnelActor {
    pub(crate) handle: Arc<TunnelHandle>,
    pub(crate) registry: Addr<Registry>,
    pub(crate) connection: Option<Connection>,
    pub(crate) keepalive: Option<(tether_tunnel::keepalive::Pinger, Duration, Duration)>,
    pub(crate) sampling: Option<WindowSampling>,
    pub(crate) watchdog: Watchdog,
    /// `tether_broker_tunnel_wedged_total{detector}`.
    pub(crate) wedged: prometheus::IntCounterVec,
    /// Test-only fault injection (config `test_hooks`), with the token that makes the
    /// connection task panic.
    pub(crate) hooks: Option<(Arc<TestHooks>, CancellationToken)>,
}

impl Actor for TunnelActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.registry.do_send(Register(Arc::clone(&self.handle)));
        if let Some((hooks, connection)) = &self.hooks {
            hooks.add(
                self.handle.id,
                &self.handle.cluster,
                ctx.address().recipient(),
                connection.clone(),
            );
        }
        let (pp, interval, timeout) = self.keepalive.take().expect("started once");
        let connection = self.connection.take().expect("started once");
        let sampling = self.sampling.take();
        let cluster = self.handle.cluster.clone();
        let id = self.handle.id;
        let handle = Arc::clone(&self.handle);
        let watchdog = self
            .watchdog
            .clone()
            .named(format!("cluster {cluster} tunnel {id}"));
        let wedged = self.wedged.clone();
        let watch = async move {
            let progress = Arc::clone(&watchdog.progress);
            let keepalive = tether_tunnel::keepalive::run_probed(
                pp,
                interval,
                timeout,
                handle.rtt_cell(),
                sampling,
                Some(&progress),
            );
            tokio::select! {
                r = connection => match r {
                    Ok(reason) => reason,
                    Err(e) if e.is_panic() => {
                        tracing::error!(%cluster, tunnel = id, "tunnel connection task panicked");
                        "connection task panicked".into()
                    }
                    Err(_) => "connection task cancelled".into(),
                },
                e = keepalive => {
                    if matches!(e, tether_tunnel::keepalive::KeepaliveError::Timeout(_)) {
                        wedged.with_label_values(&["keepalive"]).inc();
                        tracing::warn!(%cluster, tunnel = id, reason = %e, "tunnel wedged: tearing it down");
                    }
                    e.to_string()
                }
                w = watchdog.run() => {
                    wedged.with_label_values(&["watchdog"]).inc();
                    tracing::warn!(%cluster, tunnel = id, reason = %w, "tunnel wedged: tearing it down");
                    // Dropping the connection (the actor stops) ends its streams with an error
                    // now, not when TCP finally gives up; the agent's own watchdog redials.
                    w.to_string()
                }
            }
        };
        ctx.spawn(watch.into_actor(self).map(|reason, act, ctx| {
            tracing::info!(cluster = %act.handle.cluster, tunnel = act.handle.id, %reason, "tunnel connection ended");
            ctx.stop();
        }));
    }
}

impl Drop for TunnelActor {
    /// Runs however the actor ends (stopped, or dropped by a panic in one of its handlers): the
    /// connection is closed (its task is aborted with the dropped context) and the tunnel leaves
    /// the registry.
    fn drop(&mut self) {
        self.handle.close();
        if let Some((hooks, _)) = &self.hooks {
            hooks.remove(self.handle.id);
        }
        self.registry.do_send(Deregister {
            cluster: self.handle.cluster.clone(),
            tunnel_id: self.handle.id,
        });
    }
}

impl Handler<test_hooks::Panic> for TunnelActor {
    type Result = ();
    fn handle(&mut self, _: test_hooks::Panic, _: &mut Context<Self>) {
        panic!(
            "test hook: tunnel actor {} of cluster {} panics",
            self.handle.id, self.handle.cluster
        );
    }
}
