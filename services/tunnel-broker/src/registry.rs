//! The registry actor: which tunnels serve which cluster.
//!
//! The actor owns the map and is the only writer; after every change it publishes an immutable
//! [`RouteTable`] through a `watch` channel, so front ends look a cluster up without a mailbox
//! round trip on the hot path. Several tunnels per cluster are allowed (agent replicas, or the
//! old and new tunnel during a reconnect); a stream goes to the one with the fewest open streams.

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::watch;

use crate::handle::TunnelHandle;

/// Immutable snapshot of cluster → tunnels.
#[derive(Default)]
pub struct RouteTable {
    pub clusters: HashMap<String, Vec<Arc<TunnelHandle>>>,
}

impl RouteTable {
    /// The least-loaded tunnel of `cluster` that is not draining nor suspected wedged.
    pub fn pick(&self, cluster: &str) -> Option<Arc<TunnelHandle>> {
        self.clusters
            .get(cluster)?
            .iter()
            .filter(|t| !t.is_draining() && !t.is_suspect())
            .min_by_key(|t| t.open_streams())
            .cloned()
    }

    /// A tunnel of `cluster` the wedged-tunnel watchdog suspects (no other is usable), with
    /// how long its bytes have gone unanswered.
    pub fn suspect(&self, cluster: &str) -> Option<std::time::Duration> {
        self.clusters
            .get(cluster)?
            .iter()
            .filter(|t| t.is_suspect())
            .find_map(|t| t.unanswered())
    }

    pub fn tunnel_count(&self) -> usize {
        self.clusters.values().map(Vec::len).sum()
    }
}

pub struct Registry {
    tunnels: HashMap<String, Vec<Arc<TunnelHandle>>>,
    tx: watch::Sender<Arc<RouteTable>>,
    tunnels_gauge: prometheus::IntGauge,
}

impl Registry {
    pub fn new(tunnels_gauge: prometheus::IntGauge) -> (Self, watch::Receiver<Arc<RouteTable>>) {
        let (tx, rx) = watch::channel(Arc::new(RouteTable::default()));
        (
            Self {
                tunnels: HashMap::new(),
                tx,
                tunnels_gauge,
            },
            rx,
        )
    }

    fn publish(&self) {
        let table = RouteTable {
            clusters: self.tunnels.clone(),
        };
        self.tunnels_gauge.set(table.tunnel_count() as i64);
        self.tx.send_replace(Arc::new(table));
    }
}

impl Actor for Registry {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct Register(pub Arc<TunnelHandle>);

#[derive(Message)]
#[rtype(result = "()")]
pub struct Deregister {
    pub cluster: String,
    pub tunnel_id: u64,
}

/// Republish after a tunnel's draining flag changed.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Refresh;

impl Handler<Register> for Registry {
    type Result = ();
    fn handle(&mut self, msg: Register, _: &mut Context<Self>) {
        let t = msg.0;
        tracing::info!(cluster = %t.cluster, agent = %t.agent, tunnel = t.id, "tunnel registered");
        self.tunnels.entry(t.cluster.clone()).or_default().push(t);
        self.publish();
    }
}

impl Handler<Deregister> for Registry {
    type Result = ();
    fn handle(&mut self, msg: Deregister, _: &mut Context<Self>) {
        if let Some(list) = self.tunnels.get_mut(&msg.cluster) {
            list.retain(|t| t.id != msg.tunnel_id);
            if list.is_empty() {
                self.tunnels.remove(&msg.cluster);
            }
        }
        tracing::info!(cluster = %msg.cluster, tunnel = msg.tunnel_id, "tunnel deregistered");
        self.publish();
    }
}

impl Handler<Refresh> for Registry {
    type Result = ();
    fn handle(&mut self, _: Refresh, _: &mut Context<Self>) {
        self.publish();
    }
}

/// Closes every tunnel whose cluster the hub no longer accepts (deleted, denied or never
/// registered), telling the agent why. The tunnel actors then deregister them.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct CloseUnadmitted(pub Arc<crate::clusters::ClusterDirectory>);

impl Handler<CloseUnadmitted> for Registry {
    type Result = usize;
    fn handle(&mut self, msg: CloseUnadmitted, _: &mut Context<Self>) -> usize {
        let mut closed = 0;
        for (cluster, list) in &self.tunnels {
            let Err(reason) = msg.0.admit(cluster) else {
                continue;
            };
            for t in list {
                tracing::info!(cluster = %cluster, tunnel = t.id, %reason, "closing tunnel: cluster not accepted by the hub");
                let t = Arc::clone(t);
                let reason = reason.clone();
                tokio::spawn(async move { t.refuse_and_close(&reason).await });
                closed += 1;
            }
        }
        closed
    }
}
