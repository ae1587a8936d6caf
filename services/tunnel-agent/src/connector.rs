//! The connector actor: one per broker endpoint, keeps a tunnel to it.
//!
//! State machine: `connect` → tunnel task runs (tokio, off the actor's thread) → the task ends →
//! classify, back off with jitter (reset after a healthy period) → `connect` again. A `drain`
//! from the broker moves the endpoint to its next address at once, while the draining tunnel
//! keeps serving its open streams until the broker closes it. Run under an actix `Supervisor`:
//! if the actor stops it is restarted with its backoff state intact.
//!
//! Supervision of a crash: a panic in one of the actor's handlers ends its task and drops the
//! `Connector` (actix does not catch it). `Drop` then lets the connector's tunnels drain (their
//! tokens are cancelled: GOAWAY, open streams finish) and fires its [`ExitSignal`]; the agent's
//! supervisor (`Running` in `lib.rs`) starts a new connector for the endpoint, which redials.
//! A panic of the tunnel task itself ends that tunnel like a lost connection: the connector
//! redials after its backoff. Other endpoints' connectors and tunnels are untouched either way.
//! With the config's `test_hooks`, the admin listener can cause both panics
//! ([`tether_runtime::test_hooks`], tunnels named by `endpoint`).
//!
//! Config reload (see `lib.rs`): [`Reconfigure`] swaps the shared settings (proxy, policy, …)
//! and replaces the tunnel — the new one dials through the new proxy, the old one drains; a
//! connector whose endpoint left the config is stopped with [`StopConnector`] (its tunnels
//! drain) without touching the others — or, with `keep_removed_brokers_connected` and a
//! tunnel established, [`Retire`]d: the tunnel is kept until it ends and is not redialled.
//! A connector whose working tunnel reaches an endpoint of the new config (the same broker
//! under another name or address list) is told to [`Adopt`] that endpoint: it keeps its tunnel
//! and streams, and only its label and addresses change.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use rustls::pki_types::{CertificateDer, ServerName};
use tether_runtime::Backoff;
use tether_runtime::test_hooks::{self, TestHooks};
use tether_telemetry::Readiness;
use tether_tls::TlsMaterial;
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use crate::config::BrokerEndpoint;
use crate::tunnel::{AgentShared, TunnelError, TunnelEvent, run_tunnel};

/// Events buffered between a tunnel task and its connector.
pub const TUNNEL_EVENT_BUFFER: usize = 16;
/// How long a draining address is avoided.
pub const DRAIN_AVOID: Duration = Duration::from_secs(30);

/// Ids of this process's tunnels in the test hooks' table ([`TestHooks`]).
static NEXT_HOOKED_TUNNEL: AtomicU64 = AtomicU64::new(1);

/// Fires (its receiver resolves) when the [`Connector`] holding it is dropped: its actor's task
/// ended, by a panic or because nothing can reach it any more. The agent's supervisor watches
/// the receiver.
pub struct ExitSignal {
    _fires_when_dropped: oneshot::Sender<()>,
}

impl ExitSignal {
    /// A signal and the receiver that resolves when it is dropped.
    pub fn new() -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (
            Self {
                _fires_when_dropped: tx,
            },
            rx,
        )
    }
}

/// Connection state of every endpoint, shared by the connectors; drives `/readyz`.
#[derive(Clone)]
pub struct EndpointStates {
    inner: Arc<Mutex<HashMap<String, Option<String>>>>,
    /// Endpoint → the broker at the other end of its current tunnel.
    brokers: Arc<Mutex<HashMap<String, Peer>>>,
    readiness: Readiness,
}

/// The broker at the other end of an established tunnel.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Its id, from its `hello`.
    pub broker: String,
    /// The certificate it presented (its chain was checked against the hub CA at the handshake).
    pub certificate: Option<CertificateDer<'static>>,
}

impl Peer {
    /// Whether the certificate this broker presented is valid for `server_name` too: then an
    /// endpoint naming it so may take over the tunnel without a new handshake.
    pub fn valid_for(&self, server_name: &str) -> bool {
        let (Some(cert), Ok(name)) = (&self.certificate, ServerName::try_from(server_name)) else {
            return false;
        };
        rustls::server::ParsedCertificate::try_from(cert)
            .and_then(|parsed| rustls::client::verify_server_name(&parsed, &name))
            .is_ok()
    }
}

/// One endpoint in `/debug/agent`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointState {
    pub address: Option<String>,
    pub broker: Option<String>,
}

impl EndpointStates {
    pub fn new(endpoints: impl IntoIterator<Item = String>, readiness: Readiness) -> Self {
        let map = endpoints.into_iter().map(|e| (e, None)).collect();
        let s = Self {
            inner: Arc::new(Mutex::new(map)),
            brokers: Arc::new(Mutex::new(HashMap::new())),
            readiness,
        };
        s.publish();
        s
    }

    fn set(&self, endpoint: &str, connected_to: Option<String>) {
        if connected_to.is_none() {
            self.brokers.lock().expect("states lock").remove(endpoint);
        }
        self.inner
            .lock()
            .expect("states lock")
            .insert(endpoint.to_owned(), connected_to);
        self.publish();
    }

    fn set_broker(&self, endpoint: &str, peer: Peer) {
        self.brokers
            .lock()
            .expect("states lock")
            .insert(endpoint.to_owned(), peer);
    }

    /// `old` is called `new` now (its connector [`Adopt`]ed a renamed endpoint).
    fn rename(&self, old: &str, new: &str) {
        {
            let mut brokers = self.brokers.lock().expect("states lock");
            if let Some(p) = brokers.remove(old) {
                brokers.insert(new.to_owned(), p);
            }
        }
        {
            let mut inner = self.inner.lock().expect("states lock");
            let state = inner.remove(old).flatten();
            inner.insert(new.to_owned(), state);
        }
        self.publish();
    }

    /// A new endpoint (config reload): not connected yet.
    pub fn add(&self, endpoint: &str) {
        self.set(endpoint, None);
    }

    /// An endpoint left the config.
    pub fn remove(&self, endpoint: &str) {
        self.brokers.lock().expect("states lock").remove(endpoint);
        self.inner.lock().expect("states lock").remove(endpoint);
        self.publish();
    }

    /// Ids of the brokers this agent holds an established tunnel to, sorted.
    pub fn connected_brokers(&self) -> Vec<String> {
        let inner = self.inner.lock().expect("states lock");
        let brokers = self.brokers.lock().expect("states lock");
        let mut v: Vec<String> = brokers
            .iter()
            .filter(|(e, _)| inner.get(*e).is_some_and(Option::is_some))
            .map(|(_, p)| p.broker.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Endpoint → address and broker id, for `/debug/agent`.
    pub fn detail(&self) -> std::collections::BTreeMap<String, EndpointState> {
        let inner = self.inner.lock().expect("states lock");
        let brokers = self.brokers.lock().expect("states lock");
        inner
            .iter()
            .map(|(e, a)| {
                (
                    e.clone(),
                    EndpointState {
                        address: a.clone(),
                        broker: a.as_ref().and(brokers.get(e).map(|p| p.broker.clone())),
                    },
                )
            })
            .collect()
    }

    fn publish(&self) {
        let map = self.inner.lock().expect("states lock");
        let down: Vec<&str> = map
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.as_str())
            .collect();
        if down.is_empty() {
            self.readiness.set_ready();
        } else {
            self.readiness.set_not_ready(format!(
                "no tunnel to broker endpoint(s): {}",
                down.join(", ")
            ));
        }
    }

    /// Endpoint → broker address currently carrying its tunnel.
    pub fn snapshot(&self) -> HashMap<String, Option<String>> {
        self.inner.lock().expect("states lock").clone()
    }

    /// Id of the broker at the other end of `endpoint`'s tunnel (from its `hello`).
    pub fn broker_of(&self, endpoint: &str) -> Option<String> {
        self.peer_of(endpoint).map(|p| p.broker)
    }

    /// The broker at the other end of `endpoint`'s tunnel.
    pub fn peer_of(&self, endpoint: &str) -> Option<Peer> {
        self.brokers
            .lock()
            .expect("states lock")
            .get(endpoint)
            .cloned()
    }
}

pub struct Connector {
    pub endpoint: BrokerEndpoint,
    pub shared: Arc<AgentShared>,
    pub tls: Arc<TlsMaterial>,
    pub backoff: Backoff,
    pub states: EndpointStates,
    pub shutdown: CancellationToken,
    pub grace: Duration,
    /// Index of the address the current tunnel uses.
    pub index: usize,
    /// Generation of the current tunnel; events from older generations are draining tunnels.
    pub generation: u64,
    pub avoid: HashMap<usize, Instant>,
    pub established: HashMap<u64, String>,
    /// The certificate each live tunnel generation's broker presented.
    pub certificates: HashMap<u64, CertificateDer<'static>>,
    /// Cancellation of each live tunnel generation (cancelled = GOAWAY and drain).
    pub tunnel_tokens: HashMap<u64, CancellationToken>,
    /// The endpoint left the config while its tunnel worked ([`Retire`]): the tunnel is kept
    /// until it ends, and then not redialled.
    pub retired: bool,
    /// Retired and its tunnel ended: nothing runs.
    pub idle: bool,
    /// The agent's drain: every tunnel task (and its event pump and watcher) runs in it, and
    /// shutdown waits on it so each tunnel's last frames and its GOAWAY are flushed before the
    /// process exits.
    pub tunnels: tether_runtime::Drain,
    /// Test-only fault injection (config `test_hooks`; `None` in production), and the hook id
    /// of each live tunnel generation.
    pub hooks: Option<Arc<TestHooks>>,
    pub hooked: HashMap<u64, u64>,
    /// Dropped with the connector: tells the supervisor to start a new one.
    pub exit: ExitSignal,
}

impl Drop for Connector {
    /// Runs however the actor's task ends (a panic in a handler included): its tunnels drain
    /// and leave the gauge and the test hooks; dropping `exit` tells the supervisor.
    fn drop(&mut self) {
        for token in self.tunnel_tokens.values() {
            token.cancel();
        }
        let label = self.label();
        for _ in self.established.drain() {
            self.shared
                .metrics
                .tunnels
                .with_label_values(&[&label])
                .dec();
        }
        if let Some(hooks) = &self.hooks {
            for (_, id) in self.hooked.drain() {
                hooks.remove(id);
            }
        }
    }
}

/// Config reload: new shared settings (proxy, policy, API server, tunnel settings). The
/// current tunnel drains and a new one is dialled with them.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Reconfigure {
    pub shared: Arc<AgentShared>,
}

/// Config reload: this endpoint is gone. Its tunnels drain; the actor does nothing more.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StopConnector;

/// Config reload: the endpoint is renamed or its addresses changed, and the connector's
/// established tunnel reaches it (same broker id or address; the broker's certificate valid
/// for the new `server_name`): keep the tunnel and its streams, take the new endpoint.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Adopt(pub BrokerEndpoint);

/// Config reload: `Retire(true)` — the endpoint left the config while its tunnel works (kept
/// until it ends, not redialled); `Retire(false)` — it is back (redialled if its tunnel ended).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Retire(pub bool);

#[derive(Message)]
#[rtype(result = "()")]
struct Ended {
    generation: u64,
    result: Result<(), TunnelError>,
}

#[derive(Message)]
#[rtype(result = "()")]
struct Event {
    generation: u64,
    event: TunnelEvent,
}

impl Actor for Connector {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.connect(ctx);
    }
}

impl Supervised for Connector {
    fn restarting(&mut self, _ctx: &mut Self::Context) {
        tracing::warn!(endpoint = %self.endpoint.label(), "connector restarting");
        self.established.clear();
    }
}

impl Connector {
    fn label(&self) -> String {
        self.endpoint.label()
    }

    fn pick_address(&mut self) -> usize {
        let n = self.endpoint.addresses.len();
        self.avoid.retain(|_, since| since.elapsed() < DRAIN_AVOID);
        (0..n)
            .map(|k| (self.index + k) % n)
            .find(|i| !self.avoid.contains_key(i))
            .unwrap_or(self.index % n)
    }

    fn connect(&mut self, ctx: &mut Context<Self>) {
        if self.shutdown.is_cancelled() {
            return;
        }
        self.index = self.pick_address();
        self.generation += 1;
        let generation = self.generation;
        let addr = self.endpoint.addresses[self.index].clone();
        let server_name = match rustls::pki_types::ServerName::try_from(
            self.endpoint.server_name.clone(),
        ) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(server_name = %self.endpoint.server_name, error = %e, "invalid broker server name");
                return;
            }
        };
        let connector = match self.tls.client_config(self.shared.settings.protocol.alpn()) {
            Ok(c) => TlsConnector::from(Arc::new(c)),
            Err(e) => {
                tracing::error!(error = %e, "cannot build TLS client config");
                return;
            }
        };
        tracing::debug!(endpoint = %self.label(), %addr, generation, "connecting");
        let (ev_tx, mut ev_rx) = mpsc::channel(TUNNEL_EVENT_BUFFER);
        let me = ctx.address();
        self.tunnels.spawn("tunnel events", async move {
            while let Some(event) = ev_rx.recv().await {
                if me.send(Event { generation, event }).await.is_err() {
                    return;
                }
            }
        });
        let token = self.shutdown.child_token();
        self.tunnel_tokens.insert(generation, token.clone());
        let panic = self.hooks.clone().map(|hooks| {
            let id = NEXT_HOOKED_TUNNEL.fetch_add(1, Ordering::Relaxed);
            let panic = CancellationToken::new();
            hooks.add(id, &self.label(), ctx.address().recipient(), panic.clone());
            self.hooked.insert(generation, id);
            panic
        });
        let tunnel = run_tunnel(
            addr,
            server_name,
            connector,
            Arc::clone(&self.shared),
            ev_tx,
            token,
            self.grace,
        );
        let task = self
            .tunnels
            .spawn("tunnel", test_hooks::panics_on(tunnel, panic));
        let me = ctx.address();
        self.tunnels.spawn("tunnel watcher", async move {
            let result = task
                .await
                .unwrap_or_else(|e| Err(TunnelError::Lost(format!("tunnel task failed: {e}"))));
            me.do_send(Ended { generation, result });
        });
    }
}

impl Handler<Event> for Connector {
    type Result = ();

    fn handle(&mut self, msg: Event, ctx: &mut Context<Self>) {
        let label = self.label();
        match msg.event {
            TunnelEvent::Authenticated { certificate } => {
                self.certificates.insert(msg.generation, certificate);
            }
            TunnelEvent::Established { broker } => {
                let addr = self.endpoint.addresses[self.index].clone();
                if msg.generation == self.generation {
                    let peer = Peer {
                        broker: broker.clone(),
                        certificate: self.certificates.get(&msg.generation).cloned(),
                    };
                    self.states.set_broker(&label, peer);
                }
                tracing::info!(endpoint = %label, %addr, %broker, "tunnel established");
                self.backoff.succeeded();
                self.established.insert(msg.generation, addr.clone());
                self.shared
                    .metrics
                    .tunnels
                    .with_label_values(&[&label])
                    .inc();
                self.shared
                    .metrics
                    .tunnel_connects
                    .with_label_values(&[&label, "ok"])
                    .inc();
                if msg.generation == self.generation && !self.shutdown.is_cancelled() {
                    self.states.set(&label, Some(addr));
                }
            }
            TunnelEvent::Drain => {
                if msg.generation != self.generation {
                    return;
                }
                if self.retired {
                    // Not in the config any more: let it drain, dial nothing else.
                    tracing::info!(endpoint = %label, "broker of a removed endpoint is draining");
                    self.states.remove(&label);
                    return;
                }
                tracing::info!(endpoint = %label, "broker is draining; moving to another address");
                self.avoid.insert(self.index, Instant::now());
                self.index = (self.index + 1) % self.endpoint.addresses.len();
                self.states.set(&label, None);
                self.connect(ctx);
            }
        }
    }
}

impl Handler<Ended> for Connector {
    type Result = ();

    fn handle(&mut self, msg: Ended, ctx: &mut Context<Self>) {
        let label = self.label();
        self.tunnel_tokens.remove(&msg.generation);
        self.certificates.remove(&msg.generation);
        if let (Some(hooks), Some(id)) = (&self.hooks, self.hooked.remove(&msg.generation)) {
            hooks.remove(id);
        }
        if self.established.remove(&msg.generation).is_some() {
            self.shared
                .metrics
                .tunnels
                .with_label_values(&[&label])
                .dec();
        }
        match &msg.result {
            Ok(()) => {
                tracing::info!(endpoint = %label, generation = msg.generation, "tunnel closed")
            }
            Err(e) => {
                tracing::warn!(endpoint = %label, generation = msg.generation, error = %e, "tunnel ended");
                self.shared
                    .metrics
                    .tunnel_connects
                    .with_label_values(&[&label, e.metric_label()])
                    .inc();
            }
        }
        if msg.generation != self.generation || self.shutdown.is_cancelled() {
            return; // a draining tunnel finished, or we are stopping
        }
        if self.retired {
            tracing::info!(endpoint = %label, "the tunnel of an endpoint removed from the config ended; not redialling");
            self.states.remove(&label);
            self.idle = true;
            return;
        }
        self.states.set(&label, None);
        if msg.result.is_err() {
            // Try the next address of the group on the next attempt.
            self.index = (self.index + 1) % self.endpoint.addresses.len();
        }
        let delay = self.backoff.failed();
        tracing::debug!(endpoint = %label, ?delay, attempt = self.backoff.attempts(), "reconnecting after backoff");
        ctx.run_later(delay, |act, ctx| act.connect(ctx));
    }
}

impl Handler<Reconfigure> for Connector {
    type Result = ();

    fn handle(&mut self, msg: Reconfigure, ctx: &mut Context<Self>) {
        if self.shutdown.is_cancelled() {
            return;
        }
        self.shared = msg.shared;
        if self.retired {
            // Removed from the config: its tunnel drains, nothing is dialled.
            if let Some(t) = self.tunnel_tokens.get(&self.generation) {
                t.cancel();
            }
            return;
        }
        tracing::info!(endpoint = %self.label(), "settings changed: replacing the tunnel");
        // The current tunnel drains (GOAWAY, open streams finish); its end is then ignored as
        // an older generation.
        if let Some(t) = self.tunnel_tokens.get(&self.generation) {
            t.cancel();
        }
        self.states.set(&self.label(), None);
        self.backoff.reset();
        self.connect(ctx);
    }
}

impl Handler<Retire> for Connector {
    type Result = ();

    fn handle(&mut self, msg: Retire, ctx: &mut Context<Self>) {
        self.retired = msg.0;
        if !self.retired && self.idle && !self.shutdown.is_cancelled() {
            self.idle = false;
            self.states.add(&self.label());
            self.backoff.reset();
            self.connect(ctx);
        }
    }
}

impl Handler<Adopt> for Connector {
    type Result = ();

    fn handle(&mut self, Adopt(endpoint): Adopt, ctx: &mut Context<Self>) {
        let old = self.label();
        let new = endpoint.label();
        let addr = self.established.get(&self.generation).cloned();
        tracing::info!(endpoint = %new, previously = %old, address = ?addr, "endpoint renamed or re-addressed in the config: it keeps its tunnel");
        // Later redials go through the new address list, starting from the connected address.
        self.index = addr
            .and_then(|a| endpoint.addresses.iter().position(|e| *e == a))
            .unwrap_or(0);
        self.avoid.clear();
        self.endpoint = endpoint;
        self.retired = false;
        if old != new {
            self.states.rename(&old, &new);
            let gauge = &self.shared.metrics.tunnels;
            let n = i64::try_from(self.established.len()).unwrap_or(i64::MAX);
            gauge.with_label_values(&[&old]).sub(n);
            gauge.with_label_values(&[&new]).add(n);
            if let Some(hooks) = &self.hooks {
                for id in self.hooked.values() {
                    hooks.rename(*id, &new);
                }
            }
        }
        if self.idle && !self.shutdown.is_cancelled() {
            // A retired tunnel that ended just before: the endpoint is wanted again.
            self.idle = false;
            self.backoff.reset();
            self.connect(ctx);
        }
    }
}

impl Handler<StopConnector> for Connector {
    type Result = ();

    fn handle(&mut self, _: StopConnector, _ctx: &mut Context<Self>) {
        tracing::info!(endpoint = %self.label(), "endpoint removed from the config: stopping");
        self.shutdown.cancel();
        self.states.remove(&self.label());
    }
}

impl Handler<test_hooks::Panic> for Connector {
    type Result = ();

    fn handle(&mut self, _: test_hooks::Panic, _: &mut Context<Self>) {
        panic!(
            "test hook: the connector of endpoint {} panics",
            self.label()
        );
    }
}
