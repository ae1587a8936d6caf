//! tunnel-agent: runs in a managed cluster, keeps a tunnel to every broker endpoint and dials
//! targets inside the cluster for each stream a broker opens.
//!
//! Layout:
//! - [`config`]: the YAML config, validated with errors naming the field.
//! - [`connector`]: one supervised actix actor per broker endpoint (reconnect, backoff, drain).
//! - [`tunnel`]: one tunnel connection: TLS client + HTTP/2 server, request handlers, dialling.
//! - [`metrics`]: Prometheus metrics.
//! - [`net`]: dialling a target without a reactor turn when `connect()` already completed.
//! - [`service_proxy`]: the agent end of the brokers' HTTP service proxy (`service_proxy`).
//!
//! [`run`] is what `main` calls, and what tests call in-process.
//!
//! Config reload: the config file is checked every [`CONFIG_CHECK_INTERVAL`]. A valid new
//! config is applied without a restart: connectors for brokers that left are stopped (their
//! tunnels drain), connectors for new brokers start, the others are untouched — unless the
//! proxy (or the API server, policy, dial cap, tunnel settings) changed, in which case each
//! connector replaces its tunnel, dialling through the new proxy. An invalid new config is
//! refused: the old one keeps running, the field error is logged and shown in `/debug/agent`
//! (`configError`) and the metric `tether_agent_config_invalid` is 1. `/debug/agent` also lists
//! `connectedBrokers` (ids of the brokers with an established tunnel) and `configSha256` (the
//! file content running now), which the registration-agent reads.
//!
//! Supervision: a connector whose actor task dies (a panic in a handler) is replaced by a new
//! connector for the same endpoint at once (`tether_agent_connector_restarts_total`); see
//! [`connector`].

#![forbid(unsafe_code)]

pub mod config;
pub mod connector;
pub mod metrics;
pub mod net;
pub mod resolve;
pub mod service_proxy;
pub mod tunnel;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use tether_runtime::Backoff;
use tether_telemetry::{AdminServer, Readiness};
use tether_tls::TlsMaterial;
use tether_tunnel::pump::ByteCounters;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{AgentConfig, BrokerEndpoint};
use crate::connector::{
    Adopt, Connector, EndpointStates, ExitSignal, Reconfigure, Retire, StopConnector,
};
use crate::metrics::AgentMetrics;
use crate::tunnel::AgentShared;

/// How often the config file is checked for changes.
pub const CONFIG_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Time beyond `shutdown_grace` that shutdown waits for tunnels to flush their GOAWAY and close.
pub const SHUTDOWN_FLUSH_MARGIN: Duration =
    tether_tunnel::lingering::LINGER_TIMEOUT.saturating_add(Duration::from_secs(1));

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("TLS material: {0}")]
    Tls(#[from] tether_tls::TlsError),
    #[error("certificate identity: {0}")]
    Identity(#[from] tether_tls::IdentityError),
    #[error("the agent certificate names {found}, not the tunnel agent of cluster {configured}")]
    WrongCertificate { found: String, configured: String },
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("proxy settings: {0}")]
    Proxy(tether_config::ConfigError),
    #[error("{0}")]
    ServiceProxy(#[from] service_proxy::ServiceProxyError),
}

/// What `/debug/agent` shows about the config.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ConfigStatus {
    /// SHA-256 (hex) of the config file content running now.
    config_sha256: String,
    /// How many configs have been applied (1 = the one at start).
    config_generation: u64,
    /// Why the file on disk is not running (field error), if it is not.
    config_error: Option<String>,
    /// Fields that changed but need a restart to take effect.
    restart_required: Vec<String>,
}

struct ReloadMetrics {
    reloads: IntCounterVec,
    invalid: IntGauge,
    /// Connectors replaced after their actor's task died (a panic), per endpoint.
    connector_restarts: IntCounterVec,
}

impl ReloadMetrics {
    fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            reloads: IntCounterVec::new(
                Opts::new(
                    "tether_agent_config_reloads_total",
                    "Config file changes seen, by result (applied, invalid).",
                ),
                &["result"],
            )?,
            invalid: IntGauge::new(
                "tether_agent_config_invalid",
                "1 while the config file on disk is invalid and the previous config keeps running.",
            )?,
            connector_restarts: IntCounterVec::new(
                Opts::new(
                    "tether_agent_connector_restarts_total",
                    "Broker-endpoint connectors started again after their actor's task died (a panic).",
                ),
                &["endpoint"],
            )?,
        };
        registry.register(Box::new(m.reloads.clone()))?;
        registry.register(Box::new(m.invalid.clone()))?;
        registry.register(Box::new(m.connector_restarts.clone()))?;
        Ok(m)
    }
}

use tether_tls::sha256_hex;

/// Everything that a new [`AgentShared`] is built from, as a comparable fingerprint (proxy
/// URLs with their passwords, and the proxy CA's content).
fn shared_fingerprint(cfg: &AgentConfig) -> String {
    let proxy = cfg.proxy.as_ref().map(|p| {
        let ca = p
            .ca_bundle
            .as_ref()
            .map(|f| sha256_hex(&std::fs::read(f).unwrap_or_default()));
        (
            p.http_proxy.clone(),
            p.https_proxy.clone(),
            p.no_proxy.clone(),
            p.ca_bundle.clone(),
            ca,
        )
    });
    format!(
        "{proxy:?}|{}|{:?}|{:?}|{:?}|{:?}|{:?}",
        cfg.apiserver,
        cfg.policy,
        cfg.max_dial_timeout,
        cfg.dns_cache,
        cfg.tunnel,
        cfg.service_proxy
    )
}

fn build_shared(
    cfg: &AgentConfig,
    agent: &str,
    metrics: &AgentMetrics,
    counters: &ByteCounters,
) -> Result<Arc<AgentShared>, AgentError> {
    let proxy = cfg.proxy_settings().map_err(AgentError::Proxy)?;
    let proxy_ca = cfg
        .proxy
        .as_ref()
        .and_then(|p| p.ca_bundle.clone())
        .unwrap_or_else(|| cfg.tls.ca.clone());
    let proxy_roots = Arc::new(tether_tls::reload::load_roots(&proxy_ca)?);
    if !proxy.is_empty() {
        tracing::info!(
            ?proxy,
            "brokers are reached through a forward proxy unless NO_PROXY exempts them"
        );
    }
    let service_proxy = cfg
        .service_proxy
        .as_ref()
        .map(|s| {
            service_proxy::ServiceProxy::new(
                &cfg.cluster,
                &cfg.apiserver,
                &cfg.policy,
                s,
                cfg.tunnel.write_stall_timeout,
            )
            .map(Arc::new)
        })
        .transpose()?;
    Ok(Arc::new(AgentShared {
        service_proxy,
        cluster: cfg.cluster.clone(),
        agent: agent.to_string(),
        apiserver: cfg.apiserver.clone(),
        policy: cfg.policy.clone(),
        max_dial_timeout: cfg.max_dial_timeout,
        resolver: resolve::Resolver::new(
            cfg.dns_cache.clone(),
            Some(metrics.dial_resolutions.clone()),
        ),
        settings: cfg.tunnel.clone(),
        metrics: metrics.clone(),
        counters: counters.clone(),
        proxy,
        proxy_roots,
    }))
}

/// Whether an endpoint of the new config reaches the broker a removed endpoint's tunnel is
/// connected to (the same address, or named after the broker id its `hello` gave): then the
/// removed endpoint's tunnel is closed, not kept — the new endpoint dials that broker (e.g. the
/// first config's entrypoint replaced by the announced brokers), and keeping both would give
/// the cluster two tunnels to one broker.
fn wanted_reaches(
    wanted: &BTreeMap<String, BrokerEndpoint>,
    connected_to: &str,
    broker: Option<String>,
) -> bool {
    wanted.iter().any(|(label, e)| {
        broker.as_deref() == Some(label.as_str()) || e.addresses.iter().any(|a| a == connected_to)
    })
}

fn same_endpoint(a: &BrokerEndpoint, b: &BrokerEndpoint) -> bool {
    a.addresses == b.addresses && a.server_name == b.server_name
}

/// A running connector: its endpoint, its actor, and which start of the endpoint's connector it
/// is (a restarted connector is a new incarnation).
struct RunningConnector {
    endpoint: BrokerEndpoint,
    addr: Addr<Connector>,
    incarnation: u64,
}

/// The running connectors and what they were built from; the connectors' supervisor.
struct Running {
    cfg: AgentConfig,
    agent: String,
    shared: Arc<AgentShared>,
    shared_fp: String,
    tls: Arc<TlsMaterial>,
    states: EndpointStates,
    shutdown: CancellationToken,
    connectors: BTreeMap<String, RunningConnector>,
    /// Connectors of endpoints removed from the config that keep their working tunnel.
    retired: std::collections::BTreeSet<String>,
    metrics: AgentMetrics,
    counters: ByteCounters,
    tunnels: tether_runtime::Drain,
    /// Resolves with the incarnation of a connector when it is dropped.
    exits: FuturesUnordered<BoxFuture<'static, u64>>,
    incarnations: u64,
    hooks: Option<Arc<tether_runtime::test_hooks::TestHooks>>,
}

impl Running {
    fn start_connector(&mut self, endpoint: &BrokerEndpoint) {
        let label = endpoint.label();
        self.states.add(&label);
        self.incarnations += 1;
        let incarnation = self.incarnations;
        let (exit, exited) = ExitSignal::new();
        self.exits.push(Box::pin(async move {
            let _ = exited.await;
            incarnation
        }));
        let c = Connector {
            endpoint: endpoint.clone(),
            shared: Arc::clone(&self.shared),
            tls: Arc::clone(&self.tls),
            backoff: Backoff::new((&self.cfg.backoff).into()),
            states: self.states.clone(),
            shutdown: self.shutdown.child_token(),
            grace: self.cfg.shutdown_grace,
            index: 0,
            generation: 0,
            avoid: Default::default(),
            established: Default::default(),
            certificates: Default::default(),
            tunnel_tokens: Default::default(),
            retired: false,
            idle: false,
            tunnels: self.tunnels.clone(),
            hooks: self.hooks.clone(),
            hooked: Default::default(),
            exit,
        };
        let addr = Supervisor::start_in_arbiter(&Arbiter::current(), move |_| c);
        self.connectors.insert(
            label,
            RunningConnector {
                endpoint: endpoint.clone(),
                addr,
                incarnation,
            },
        );
    }

    /// A connector was dropped: when it is the endpoint's current one and the agent is not
    /// stopping, its actor's task died (a panic) — start a new one, which redials.
    /// (The connector is found by incarnation: it may have adopted another label since.)
    fn connector_exited(&mut self, incarnation: u64, restarts: &IntCounterVec) {
        let Some((label, c)) = self
            .connectors
            .iter()
            .find(|(_, c)| c.incarnation == incarnation)
        else {
            return; // the endpoint left the config, or a newer connector runs it
        };
        let label = label.clone();
        if self.shutdown.is_cancelled() {
            return;
        }
        if self.retired.remove(&label) {
            // Its endpoint left the config; its tunnel ended with it: not redialled.
            tracing::warn!(endpoint = %label, "connector of a removed broker died; not restarted");
            self.connectors.remove(&label);
            return;
        }
        tracing::error!(endpoint = %label, "connector died; starting a new one");
        restarts.with_label_values(&[&label]).inc();
        let endpoint = c.endpoint.clone();
        self.start_connector(&endpoint);
    }

    /// Config reload, before anything is stopped or started: a connector whose endpoint left or
    /// changed, and whose established tunnel reaches an endpoint of the new config that no other
    /// connector runs — the broker's `hello` id is that endpoint's name, or the connected address
    /// is one of its addresses — takes that endpoint over, tunnel and streams included, when the
    /// certificate the broker presented is valid for the endpoint's `server_name` too. The hub
    /// renames endpoints when its broker list falls back to the entrypoints (presence lapsed
    /// during a NATS failover) and back; without this, each rename would cut every stream.
    fn adopt(&mut self, wanted: &BTreeMap<String, BrokerEndpoint>) {
        let connected = self.states.snapshot();
        let mut moves: Vec<(String, String)> = Vec::new();
        for (label, c) in &self.connectors {
            if wanted
                .get(label)
                .is_some_and(|w| same_endpoint(w, &c.endpoint))
            {
                continue;
            }
            let (Some(addr), Some(peer)) = (
                connected.get(label).and_then(Option::as_deref),
                self.states.peer_of(label),
            ) else {
                continue;
            };
            let free = |l: &String| {
                (l == label || !self.connectors.contains_key(l))
                    && !moves.iter().any(|(_, to)| to == l)
            };
            let target = wanted.iter().find(|(l, w)| {
                free(l)
                    && (peer.broker == **l || w.addresses.iter().any(|a| a == addr))
                    && (w.server_name == c.endpoint.server_name || peer.valid_for(&w.server_name))
            });
            if let Some((to, _)) = target {
                moves.push((label.clone(), to.clone()));
            }
        }
        for (from, to) in moves {
            let Some(mut c) = self.connectors.remove(&from) else {
                continue;
            };
            self.retired.remove(&from);
            let endpoint = wanted[&to].clone();
            c.addr.do_send(Adopt(endpoint.clone()));
            c.endpoint = endpoint;
            self.connectors.insert(to, c);
        }
    }

    /// Applies a validated new config; returns the fields that need a restart.
    fn apply(&mut self, new: AgentConfig) -> Result<Vec<String>, AgentError> {
        let mut restart = Vec::new();
        let old = &self.cfg;
        if old.cluster != new.cluster {
            restart.push("cluster".to_string());
        }
        if old.agent != new.agent {
            restart.push("agent".into());
        }
        if old.tls != new.tls {
            restart.push("tls".into());
        }
        if old.admin_listen != new.admin_listen {
            restart.push("admin_listen".into());
        }
        if old.tls_reload_interval != new.tls_reload_interval {
            restart.push("tls_reload_interval".into());
        }
        if old.test_hooks != new.test_hooks {
            restart.push("test_hooks".into());
        }
        let fp = shared_fingerprint(&new);
        let reconfigure = fp != self.shared_fp;
        if reconfigure {
            self.shared = build_shared(&new, &self.agent, &self.metrics, &self.counters)?;
            self.shared_fp = fp;
        }
        // Keep cluster/agent/tls/admin as started; take everything else.
        let mut merged = new;
        merged.cluster = self.cfg.cluster.clone();
        merged.agent = self.cfg.agent.clone();
        merged.tls = self.cfg.tls.clone();
        merged.admin_listen = self.cfg.admin_listen;
        merged.tls_reload_interval = self.cfg.tls_reload_interval;
        merged.test_hooks = self.cfg.test_hooks;
        self.cfg = merged;

        let wanted: BTreeMap<String, BrokerEndpoint> = self
            .cfg
            .brokers
            .iter()
            .map(|b| (b.label(), b.clone()))
            .collect();
        self.adopt(&wanted);
        let connected = self.states.snapshot();
        let mut stale = Vec::new();
        for (label, c) in &self.connectors {
            match wanted.get(label) {
                Some(w) if same_endpoint(w, &c.endpoint) => {
                    if self.retired.remove(label) {
                        tracing::info!(endpoint = %label, "broker endpoint back in the config");
                        c.addr.do_send(Retire(false));
                    }
                }
                None if self.cfg.keep_removed_brokers_connected
                    && connected
                        .get(label)
                        .and_then(Option::as_deref)
                        .is_some_and(|addr| {
                            !wanted_reaches(&wanted, addr, self.states.broker_of(label))
                        }) =>
                {
                    if self.retired.insert(label.clone()) {
                        tracing::info!(endpoint = %label, "broker endpoint removed from the config; its working tunnel is kept until it ends");
                        c.addr.do_send(Retire(true));
                    }
                }
                _ => stale.push(label.clone()),
            }
        }
        for label in stale {
            self.retired.remove(&label);
            if let Some(c) = self.connectors.remove(&label) {
                tracing::info!(endpoint = %label, "broker endpoint removed or changed");
                c.addr.do_send(StopConnector);
            }
        }
        if reconfigure {
            for (label, c) in &self.connectors {
                tracing::debug!(endpoint = %label, "reconfiguring");
                c.addr.do_send(Reconfigure {
                    shared: Arc::clone(&self.shared),
                });
            }
        }
        for (label, endpoint) in wanted {
            if !self.connectors.contains_key(&label) {
                tracing::info!(endpoint = %label, "broker endpoint added");
                self.start_connector(&endpoint);
            }
        }
        Ok(restart)
    }
}

/// Runs the agent until `shutdown` with a fixed config (no file to watch); must be called inside
/// an actix `System` on a tokio runtime.
pub async fn run(
    cfg: AgentConfig,
    admin: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    run_with_reload(cfg, None, admin, shutdown).await
}

/// A config file as it was read at start: its path (watched for changes) and the SHA-256 of the
/// exact bytes the running config was parsed from.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    path: PathBuf,
    sha256: String,
}

impl ConfigFile {
    /// Reads `path` once, parses and validates it, and remembers the hash of those bytes. The
    /// hash must name what was parsed, not what the file holds a moment later: a config rewritten
    /// between the parse and a second read would otherwise count as running, and never be applied.
    pub fn load(path: &Path) -> Result<(AgentConfig, ConfigFile), tether_config::ConfigError> {
        let (cfg, bytes) = tether_config::load_with_bytes(path)?;
        Ok((
            cfg,
            ConfigFile {
                path: path.to_owned(),
                sha256: sha256_hex(&bytes),
            },
        ))
    }

    /// SHA-256 (hex) of the bytes the config was parsed from.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }
}

/// [`run`], watching `config_file` (where `cfg` came from, see [`ConfigFile::load`]) and applying
/// its changes.
pub async fn run_with_reload(
    cfg: AgentConfig,
    config_file: Option<ConfigFile>,
    admin: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let registry = Registry::new();
    let tls = TlsMaterial::load(cfg.tls.clone())?;
    tls.register(&registry)?;
    let identity = tether_tls::Identity::from_certificate(&tls.certificate())?;
    if identity.cluster() != Some(cfg.cluster.as_str()) {
        // Not fatal: the broker refuses it and says why; but say it here first, clearly.
        tracing::error!(
            certificate = %identity,
            configured = %cfg.cluster,
            "agent certificate does not belong to the configured cluster; brokers will refuse it"
        );
    }
    tls.spawn_watcher(cfg.tls_reload_interval, shutdown.child_token());
    let metrics = AgentMetrics::new(&registry)?;
    let reload_metrics = ReloadMetrics::new(&registry)?;
    let counters = ByteCounters {
        to_tunnel: Some(metrics.counter("from_target")),
        from_tunnel: Some(metrics.counter("to_target")),
    };
    let agent = cfg.agent_name();
    let shared = build_shared(&cfg, &agent, &metrics, &counters)?;
    let readiness = Readiness::new();
    let states = EndpointStates::new(cfg.brokers.iter().map(|b| b.label()), readiness.clone());
    let grace = cfg.shutdown_grace;
    if cfg.test_hooks {
        tracing::warn!(
            "test hooks on: the admin listener can make connectors panic (never in production)"
        );
    }
    let hooks = cfg
        .test_hooks
        .then(|| Arc::new(tether_runtime::test_hooks::TestHooks::new("endpoint")));
    let mut running = Running {
        shared_fp: shared_fingerprint(&cfg),
        cfg: cfg.clone(),
        agent: agent.clone(),
        shared,
        tls: Arc::clone(&tls),
        states: states.clone(),
        shutdown: shutdown.clone(),
        connectors: BTreeMap::new(),
        retired: Default::default(),
        metrics: metrics.clone(),
        counters,
        tunnels: tether_runtime::Drain::new("tunnel-agent"),
        exits: FuturesUnordered::new(),
        incarnations: 0,
        hooks: hooks.clone(),
    };
    for endpoint in &cfg.brokers {
        running.start_connector(endpoint);
    }
    tracing::info!(cluster = %cfg.cluster, %agent, endpoints = cfg.brokers.len(), "tunnel-agent started");

    let status = Arc::new(Mutex::new(ConfigStatus {
        config_sha256: config_file
            .as_ref()
            .map(|f| f.sha256.clone())
            .unwrap_or_default(),
        config_generation: 1,
        ..Default::default()
    }));
    let states_dbg = states.clone();
    let states_agent = states.clone();
    let status_dbg = Arc::clone(&status);
    let admin_server = AdminServer::new(registry, readiness)
        .with_json_route("/debug/tunnels", move || {
            serde_json::to_string(&states_dbg.snapshot()).unwrap_or_default()
        })
        .with_json_route("/debug/agent", move || {
            let st = status_dbg.lock().map(|s| s.clone()).unwrap_or_default();
            serde_json::json!({
                "configSha256": st.config_sha256,
                "configGeneration": st.config_generation,
                "configError": st.config_error,
                "restartRequired": st.restart_required,
                "connectedBrokers": states_agent.connected_brokers(),
                "endpoints": states_agent.detail(),
            })
            .to_string()
        });
    let admin_server = match hooks {
        Some(hooks) => admin_server
            .with_json_query_route(tether_runtime::test_hooks::PANIC_TUNNEL_PATH, move |q| {
                hooks.answer(q)
            }),
        None => admin_server,
    };
    running.tunnels.spawn(
        "admin server",
        admin_server.serve(admin, shutdown.child_token()),
    );

    let mut tick = tokio::time::interval(CONFIG_CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(incarnation) = running.exits.next(), if !running.exits.is_empty() => {
                running.connector_exited(incarnation, &reload_metrics.connector_restarts);
                continue;
            }
            _ = tick.tick() => {}
        }
        let Some(file) = config_file.as_ref() else {
            continue;
        };
        check_config(&file.path, &mut running, &status, &reload_metrics);
    }
    tracing::info!(grace = ?grace, "shutting down: draining tunnels");
    // Tunnels see the cancellation through their child tokens: each sends GOAWAY, lets its open
    // streams finish within the grace, and ends once its connection is closed and flushed.
    // Waiting for the tunnel tasks, not for the open-stream count to reach zero, keeps a
    // stream's last bytes and END_STREAM from dying in an unflushed buffer at exit.
    // The admin server stops on the same token.
    running
        .tunnels
        .clone()
        .finish(grace + SHUTDOWN_FLUSH_MARGIN)
        .await;
    drop(running);
    Ok(())
}

/// One look at the config file: apply it when its content changed and it is valid.
fn check_config(
    path: &Path,
    running: &mut Running,
    status: &Mutex<ConfigStatus>,
    metrics: &ReloadMetrics,
) {
    let Ok(bytes) = std::fs::read(path) else {
        return; // being replaced, or gone: keep running what we have
    };
    let hash = sha256_hex(&bytes);
    let (current, failed) = status
        .lock()
        .map(|s| {
            (
                s.config_sha256.clone(),
                s.config_error.as_ref().map(|_| s.config_sha256.clone()),
            )
        })
        .unwrap_or_default();
    if hash == current {
        if failed.is_some()
            && let Ok(mut s) = status.lock()
        {
            // The file went back to the running content.
            s.config_error = None;
            metrics.invalid.set(0);
        }
        return;
    }
    let text = String::from_utf8_lossy(&bytes);
    let parsed = tether_config::from_str::<AgentConfig>(&text, path);
    let result = match parsed {
        Ok(new) => running.apply(new).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let Ok(mut s) = status.lock() else { return };
    match result {
        Ok(restart) => {
            metrics.reloads.with_label_values(&["applied"]).inc();
            metrics.invalid.set(0);
            s.config_sha256 = hash;
            s.config_generation += 1;
            s.config_error = None;
            if !restart.is_empty() {
                tracing::warn!(fields = ?restart, "config fields changed that need a restart; the rest is applied");
            }
            s.restart_required = restart;
            tracing::info!(
                generation = s.config_generation,
                brokers = running.connectors.len(),
                "config reloaded"
            );
        }
        Err(e) => {
            // Log a given bad file once, not every tick.
            if s.config_error.as_deref() != Some(e.as_str()) {
                metrics.reloads.with_label_values(&["invalid"]).inc();
                tracing::error!(error = %e, "new config is invalid; the previous config keeps running");
            }
            metrics.invalid.set(1);
            s.config_error = Some(e);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sha256_is_sha256() {
        assert_eq!(
            super::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_removed_endpoint_is_kept_only_when_no_new_endpoint_reaches_its_broker() {
        let ep = |name: &str, addr: &str| super::BrokerEndpoint {
            name: Some(name.into()),
            addresses: vec![addr.into()],
            server_name: "broker".into(),
        };
        let wanted: super::BTreeMap<String, super::BrokerEndpoint> = [ep("b1", "10.0.0.1:8443")]
            .into_iter()
            .map(|e| (e.label(), e))
            .collect();
        // The first config's entrypoint, now replaced by the broker it reached (by id, by address).
        assert!(super::wanted_reaches(&wanted, "lb:443", Some("b1".into())));
        assert!(super::wanted_reaches(&wanted, "10.0.0.1:8443", None));
        // A broker that left the list while its tunnel works: kept.
        assert!(!super::wanted_reaches(
            &wanted,
            "10.0.0.2:8443",
            Some("b2".into())
        ));
        assert!(!super::wanted_reaches(&wanted, "10.0.0.2:8443", None));
    }
}
