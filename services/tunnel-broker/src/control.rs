//! The broker's control-plane connection (optional `control_plane` config section).
//!
//! One task keeps a NATS connection as user `tether-hub` and runs *sessions*: open the hub
//! store, announce presence, read the buckets the broker follows, then renew presence every
//! [`PRESENCE_RENEW`] and apply KV changes as they arrive:
//!
//! | bucket | effect |
//! |---|---|
//! | `tether-brokers` | relay peers ([`PeerManager`]) |
//! | `tether-managedclusters` | [`ClusterDirectory`]: tunnels of unknown / not accepted clusters are refused and closed; clients get `unknown_cluster` |
//! | `tether-hubclients`, `tether-clientaccesspolicies` | client credentials and policy (`auth::Auth::set_hub`) |
//!
//! A failed renewal or a watch that ends closes the session; the next one starts after a
//! jittered backoff (and re-announces). Nothing on the data plane waits for NATS: routes,
//! peers, the cluster directory and client policy keep their last-known state, and `/readyz`
//! and `/metrics` do not depend on NATS (`tether_broker_control_plane_connected` shows it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use actix::prelude::*;
use futures::StreamExt;
use tether_control::brokers::{BrokerPresence, PRESENCE_MISSES, PRESENCE_RENEW};
use tether_control::clients::{ClientAccessPolicy, HubClient};
use tether_control::connect::{self, ConnectConfig, Credentials};
use tether_control::kubeconfig::HubEndpoint;
use tether_control::resources::{ManagedCluster, rfc3339};
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};
use tether_runtime::{Backoff, BackoffConfig};
use tether_tunnel::pause::{Judgement, Settle};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clusters::{ClusterDirectory, ClusterInfo};
use crate::config::ControlPlaneConfig;
use crate::dial::Broker;
use crate::metrics::BrokerMetrics;
use crate::presence::PeerManager;
use crate::registry::{CloseUnadmitted, Registry, RouteTable};

/// Budget of one KV write (presence renewal, final delete).
pub const KV_WRITE_TIMEOUT: Duration = Duration::from_secs(3);
/// Budget of opening the hub store and reading the buckets at the start of a session.
pub const SESSION_START_TIMEOUT: Duration = Duration::from_secs(15);
/// How often stale peers are pruned.
pub const PRUNE_INTERVAL: Duration = Duration::from_millis(500);
/// How long a peer's presence may go without renewal before it counts as gone; also how long
/// after a pause of this process no peer is judged (its renewals need that long to be seen).
pub const PRESENCE_GRACE: Duration =
    Duration::from_secs(PRESENCE_RENEW.as_secs() * PRESENCE_MISSES as u64);

/// Why the control plane could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error("control_plane.password_file {path}: {source}")]
    Password {
        path: String,
        source: std::io::Error,
    },
    #[error("control_plane.ca {path}: {source}")]
    Ca {
        path: String,
        source: std::io::Error,
    },
    #[error("control_plane.nats_url {0:?} is not tls://host:port")]
    Url(String),
}

/// Everything the control-plane task drives.
pub struct ControlPlane {
    pub connect: ConnectConfig,
    pub me: BrokerPresence,
    pub broker: Arc<Broker>,
    pub registry: Addr<Registry>,
    pub routes: watch::Receiver<Arc<RouteTable>>,
    pub peers: Option<PeerManager>,
    pub clusters: Option<Arc<ClusterDirectory>>,
    pub metrics: BrokerMetrics,
    pub draining: watch::Receiver<bool>,
}

/// The NATS connection settings from the config (reads the CA and password files).
pub fn connect_config(cfg: &ControlPlaneConfig) -> Result<ConnectConfig, ControlPlaneError> {
    let (host, port) = tether_control::kubeconfig::parse_server(&cfg.nats_url)
        .ok_or_else(|| ControlPlaneError::Url(cfg.nats_url.clone()))?;
    let ca_pem = std::fs::read_to_string(&cfg.ca).map_err(|source| ControlPlaneError::Ca {
        path: cfg.ca.display().to_string(),
        source,
    })?;
    let password = std::fs::read_to_string(&cfg.password_file).map_err(|source| {
        ControlPlaneError::Password {
            path: cfg.password_file.display().to_string(),
            source,
        }
    })?;
    let endpoint = HubEndpoint {
        server: cfg.nats_url.clone(),
        host,
        port,
        ca_pem,
        proxy: None,
        tls_server_name: cfg.server_name.clone(),
    };
    Ok(ConnectConfig::new(
        endpoint,
        Credentials::HubUser {
            user: cfg.user.clone(),
            password: password.trim().to_owned(),
        },
        "broker",
    ))
}

/// What ended a session.
/// Why a control-plane session could not start or keep going.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("presence renewal failed: {0}")]
    Renewal(#[source] tether_control::ControlError),
    #[error("presence renewal timed out after {0:?}")]
    RenewalTimeout(std::time::Duration),
    #[error("opening the hub store: {0}")]
    Open(#[source] tether_control::ControlError),
    #[error("reading {bucket}: {source}")]
    Read {
        bucket: &'static str,
        #[source]
        source: tether_control::ControlError,
    },
}

enum SessionEnd {
    /// The broker is exiting; the store to delete the presence key with.
    Exit(Box<HubStore>),
    /// NATS trouble; start another session later.
    Lost(String),
}

impl ControlPlane {
    /// Runs until `exit`; then deletes this broker's presence entry (best effort).
    pub async fn run(mut self, exit: CancellationToken) {
        let mut backoff = Backoff::new(BackoffConfig {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(5),
            reset_after: Duration::from_secs(10),
            ..BackoffConfig::default()
        });
        let mut conn: Option<tether_control::NatsConnection> = None;
        loop {
            if conn.is_none() {
                let attempt = tokio::select! {
                    _ = exit.cancelled() => return,
                    r = tokio::time::timeout(self.connect.connect_timeout * 2, connect::connect(&self.connect)) => r,
                };
                match attempt {
                    Ok(Ok(c)) => {
                        tracing::info!(broker = %self.me.id, "connected to hub NATS");
                        conn = Some(c);
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(broker = %self.me.id, error = %e, "cannot connect to hub NATS; the data plane keeps running");
                    }
                    Err(_) => {
                        tracing::warn!(broker = %self.me.id, "connecting to hub NATS timed out; the data plane keeps running");
                    }
                }
            }
            if let Some(c) = &conn {
                let client = c.client.clone();
                match self.session(client, &exit, &mut backoff).await {
                    SessionEnd::Exit(store) => {
                        self.metrics.control_plane_connected.set(0);
                        let id = self.me.id.clone();
                        match tokio::time::timeout(
                            KV_WRITE_TIMEOUT,
                            store.delete(Bucket::Brokers, &id),
                        )
                        .await
                        {
                            Ok(Ok(())) => tracing::info!(broker = %id, "presence deleted"),
                            Ok(Err(e)) => {
                                tracing::warn!(broker = %id, error = %e, "cannot delete presence; it will go stale")
                            }
                            Err(_) => {
                                tracing::warn!(broker = %id, "deleting presence timed out; it will go stale")
                            }
                        }
                        let _ = tokio::time::timeout(KV_WRITE_TIMEOUT, c.client.flush()).await;
                        return;
                    }
                    SessionEnd::Lost(reason) => {
                        self.metrics.control_plane_connected.set(0);
                        tracing::warn!(broker = %self.me.id, %reason, "control-plane session ended; the data plane keeps its last-known state");
                    }
                }
            }
            let delay = backoff.failed();
            tokio::select! {
                _ = exit.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    fn presence(&mut self) -> BrokerPresence {
        let mut p = self.me.clone();
        p.renew_time = rfc3339(SystemTime::now());
        p.draining = *self.draining.borrow();
        p.tunnels = self.routes.borrow().tunnel_count() as u64;
        p.clusters = crate::presence::held_clusters(&self.routes.borrow());
        p.streams = self.broker.open_stream_count().max(0) as u64;
        p
    }

    async fn announce(&mut self, store: &HubStore) -> Result<(), SessionError> {
        let p = self.presence();
        let r = tokio::time::timeout(KV_WRITE_TIMEOUT, store.put(Bucket::Brokers, &p.id, &p)).await;
        let r = match r {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(SessionError::Renewal(e)),
            Err(_) => Err(SessionError::RenewalTimeout(KV_WRITE_TIMEOUT)),
        };
        self.metrics
            .presence_renewals
            .with_label_values(&[if r.is_ok() { "ok" } else { "error" }])
            .inc();
        r
    }

    fn apply_clusters(&self, all: &HashMap<String, ClusterInfo>) {
        let Some(dir) = &self.clusters else {
            return;
        };
        dir.set(all.clone());
        self.metrics.known_clusters.set(all.len() as i64);
        let registry = self.registry.clone();
        let dir = Arc::clone(dir);
        let closed = self.metrics.tunnels_closed_by_hub.clone();
        tokio::spawn(async move {
            if let Ok(n) = registry.send(CloseUnadmitted(dir)).await {
                closed.inc_by(n as u64);
            }
        });
    }

    fn apply_clients(
        &self,
        clients: &HashMap<String, HubClient>,
        policies: &HashMap<String, ClientAccessPolicy>,
    ) {
        let c: Vec<HubClient> = clients.values().cloned().collect();
        let p: Vec<ClientAccessPolicy> = policies.values().cloned().collect();
        self.broker.auth.set_hub(&c, &p);
        self.metrics
            .hub_clients
            .set(self.broker.auth.hub_client_count() as i64);
    }

    async fn session(
        &mut self,
        client: async_nats::Client,
        exit: &CancellationToken,
        backoff: &mut Backoff,
    ) -> SessionEnd {
        let exit_client = client.clone();
        let started = tokio::select! {
            _ = exit.cancelled() => return match tokio::time::timeout(KV_WRITE_TIMEOUT, HubStore::open(exit_client)).await {
                Ok(Ok(s)) => SessionEnd::Exit(Box::new(s)),
                _ => SessionEnd::Lost("exiting before the session started".into()),
            },
            r = tokio::time::timeout(SESSION_START_TIMEOUT, self.start_session(client)) => r,
        };
        let (store, mut state) = match started {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => return SessionEnd::Lost(e.to_string()),
            Err(_) => {
                return SessionEnd::Lost(format!(
                    "session start timed out after {SESSION_START_TIMEOUT:?}"
                ));
            }
        };
        let watches = async {
            Ok::<_, tether_control::ControlError>((
                store.watch::<BrokerPresence>(Bucket::Brokers).await?,
                store.watch::<ManagedCluster>(Bucket::Clusters).await?,
                store.watch::<HubClient>(Bucket::HubClients).await?,
                store
                    .watch::<ClientAccessPolicy>(Bucket::ClientAccessPolicies)
                    .await?,
            ))
        };
        let (brokers_w, clusters_w, clients_w, policies_w) =
            match tokio::time::timeout(SESSION_START_TIMEOUT, watches).await {
                Ok(Ok(w)) => w,
                Ok(Err(e)) => return SessionEnd::Lost(format!("opening KV watches: {e}")),
                Err(_) => return SessionEnd::Lost("opening KV watches timed out".into()),
            };
        tokio::pin!(brokers_w, clusters_w, clients_w, policies_w);
        self.metrics.control_plane_connected.set(1);
        backoff.succeeded();
        tracing::info!(broker = %self.me.id, peers = ?self.peers.as_ref().map(PeerManager::ids), clusters = state.clusters.len(), hub_clients = state.clients.len(), "presence announced; following the hub");
        let mut renew = tokio::time::interval(PRESENCE_RENEW);
        renew.tick().await;
        let mut prune = tokio::time::interval(PRUNE_INTERVAL);
        let mut settle = Settle::new(PRESENCE_GRACE);
        // The sender lives as long as the broker runs; once it is gone, stop polling it.
        let mut draining_open = true;
        loop {
            tokio::select! {
                _ = exit.cancelled() => return SessionEnd::Exit(Box::new(store)),
                _ = renew.tick() => {
                    if let Err(e) = self.announce(&store).await {
                        return SessionEnd::Lost(e.to_string());
                    }
                }
                r = self.draining.changed(), if draining_open => {
                    if r.is_err() {
                        draining_open = false;
                    } else if let Err(e) = self.announce(&store).await {
                        return SessionEnd::Lost(e.to_string());
                    }
                }
                due = prune.tick() => {
                    // After a pause of this process (a paused VM, SIGSTOP) the peers'
                    // renewals that came due meanwhile are still on their way: a peer is
                    // judged stale only once they have had the whole grace to arrive.
                    match settle.check(due.into_std(), std::time::Instant::now()) {
                        Judgement::Judge => {
                            if let Some(p) = &mut self.peers {
                                p.prune(SystemTime::now());
                            }
                        }
                        Judgement::Paused(paused) => tracing::info!(
                            broker = %self.me.id,
                            paused_ms = paused.as_millis() as u64,
                            settle_ms = PRESENCE_GRACE.as_millis() as u64,
                            "this broker was paused: relay peers' presence is not judged until their renewals had time to arrive"
                        ),
                        Judgement::Settling => {}
                    }
                }
                ev = brokers_w.next() => match ev {
                    Some((_, Some(p))) => {
                        if let Some(m) = &mut self.peers {
                            m.upsert(p, SystemTime::now());
                        }
                    }
                    Some((id, None)) => {
                        if let Some(m) = &mut self.peers {
                            m.remove(&id);
                        }
                    }
                    None => return SessionEnd::Lost("tether-brokers watch ended".into()),
                },
                ev = clusters_w.next() => match ev {
                    Some((name, mc)) => {
                        match mc {
                            Some(mc) => { state.clusters.insert(name, info(&mc)); }
                            None => { state.clusters.remove(&name); }
                        }
                        self.apply_clusters(&state.clusters);
                    }
                    None => return SessionEnd::Lost("tether-managedclusters watch ended".into()),
                },
                ev = clients_w.next() => match ev {
                    Some((name, c)) => {
                        match c {
                            Some(c) => { state.clients.insert(name, c); }
                            None => { state.clients.remove(&name); }
                        }
                        self.apply_clients(&state.clients, &state.policies);
                    }
                    None => return SessionEnd::Lost("tether-hubclients watch ended".into()),
                },
                ev = policies_w.next() => match ev {
                    Some((name, p)) => {
                        match p {
                            Some(p) => { state.policies.insert(name, p); }
                            None => { state.policies.remove(&name); }
                        }
                        self.apply_clients(&state.clients, &state.policies);
                    }
                    None => return SessionEnd::Lost("tether-clientaccesspolicies watch ended".into()),
                },
            }
        }
    }

    /// Opens the store, announces, and reads the followed buckets once.
    async fn start_session(
        &mut self,
        client: async_nats::Client,
    ) -> Result<(HubStore, State), SessionError> {
        let read = |bucket| move |source| SessionError::Read { bucket, source };
        let store = HubStore::open(client).await.map_err(SessionError::Open)?;
        self.announce(&store).await?;
        let mut state = State::default();
        if self.clusters.is_some() {
            let list = store
                .list::<ManagedCluster>(Bucket::Clusters)
                .await
                .map_err(read("tether-managedclusters"))?;
            state.clusters = list.into_iter().map(|(k, mc, _)| (k, info(&mc))).collect();
            self.apply_clusters(&state.clusters);
        }
        state.clients = store
            .list::<HubClient>(Bucket::HubClients)
            .await
            .map_err(read("tether-hubclients"))?
            .into_iter()
            .map(|(k, v, _)| (k, v))
            .collect();
        state.policies = store
            .list::<ClientAccessPolicy>(Bucket::ClientAccessPolicies)
            .await
            .map_err(read("tether-clientaccesspolicies"))?
            .into_iter()
            .map(|(k, v, _)| (k, v))
            .collect();
        self.apply_clients(&state.clients, &state.policies);
        if let Some(m) = &mut self.peers {
            let all = store
                .list::<BrokerPresence>(Bucket::Brokers)
                .await
                .map_err(read("tether-brokers"))?
                .into_iter()
                .map(|(_, v, _)| v)
                .collect();
            m.reconcile(all, SystemTime::now());
        }
        Ok((store, state))
    }
}

#[derive(Default)]
struct State {
    clusters: HashMap<String, ClusterInfo>,
    clients: HashMap<String, HubClient>,
    policies: HashMap<String, ClientAccessPolicy>,
}

fn info(mc: &ManagedCluster) -> ClusterInfo {
    ClusterInfo {
        accepted: mc.spec.hub_accepts_client,
        labels: mc.metadata.labels.clone(),
    }
}
