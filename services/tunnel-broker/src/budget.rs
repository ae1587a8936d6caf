//! Fairness budgets: one cluster's or one client's flood cannot take more than its share of a
//! broker.
//!
//! Every stream a front end opens is admitted here first ([`Budgets::admit`], called by
//! `dial::Broker` for CONNECT, native Dial, konnectivity, the service proxy and peer
//! relays alike). A stream counts against its **cluster** and, when a hub client opened it,
//! against that **client**:
//!
//! - *pending dials* — dials waiting for the agent's answer (`max_pending_dials_per_cluster`,
//!   `max_pending_dials_per_client`): a flood of dials to an unreachable target cannot pile up
//!   (konnectivity once held 27.7K of them until it ran out of memory);
//! - *streams* — open streams plus pending dials (`max_streams_per_cluster`,
//!   `max_streams_per_client`).
//!
//! *Bytes in flight* follow from these: toward the cluster a stream holds at most one read chunk
//! (`tunnel.read_chunk_bytes`) at the broker, since the pump reads the client only when the
//! agent's window has room; from the cluster the broker's HTTP/2 receive window of the
//! cluster's tunnel is capped at `max_buffered_bytes_per_cluster` (the connection window), so a
//! slow client cannot make the broker buffer more than that of one cluster's data. The memory
//! bound is in docs/architecture.md ("Fairness").
//!
//! Budgets bound concurrency, not bytes per second: [`FairShare`] paces a cluster that floods —
//! a budget refuses it, or it moves most of the broker's bytes for [`SUSTAINED_HEAVY_PERIODS`]
//! within its budgets — while the CPU is contended and other clusters hold streams. Every front
//! end charges the bytes it moves to the stream's [`Pacer`] (one mechanism): CONNECT and the
//! service proxy wrap their client side in [`PacedReader`] / [`PacedWriter`], the native gRPC
//! `Dial` and konnectivity byte loops call [`Pacer::charge`], and `DialRaw`'s response body
//! polls a [`PollPacer`].
//!
//! A refused dial is a [`DialErrorKind::Overloaded`] error naming the budget and its limit
//! (CONNECT 503, gRPC RESOURCE_EXHAUSTED, konnectivity DIAL_RSP error, service proxy 429) and
//! counts in `tether_broker_budget_rejections_total{budget,owner}`: `owner` is the cluster for a
//! cluster budget — only clusters with a tunnel on this broker, else `other`, so a flood of
//! made-up names adds no series — and the client's configured or hub name for a client budget.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tether_tunnel::pump::{AbortableWrite, ChunkReader};
use tokio::io::AsyncWrite;

use serde::Deserialize;
use tether_config::ConfigError;
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{DialError, settings::MAX_WINDOW};

/// Default cap of streams (open + dialling) of one cluster on one broker.
pub const DEFAULT_MAX_STREAMS_PER_CLUSTER: usize = 4096;
/// Default cap of dials of one cluster waiting for the agent's answer.
pub const DEFAULT_MAX_PENDING_DIALS_PER_CLUSTER: usize = 256;
/// Default cap of streams (open + dialling) of one hub client on one broker.
pub const DEFAULT_MAX_STREAMS_PER_CLIENT: usize = 4096;
/// Default cap of one hub client's dials waiting for an answer.
pub const DEFAULT_MAX_PENDING_DIALS_PER_CLIENT: usize = 512;
/// Default cap of bytes from one cluster's tunnel buffered at the broker (its HTTP/2
/// connection receive window).
pub const DEFAULT_MAX_BUFFERED_BYTES_PER_CLUSTER: u32 = 256 << 20;

/// Default runtime lag that counts as contention for the CPU share.
pub const DEFAULT_CPU_SHARE_LAG: Duration = Duration::from_millis(1);

/// The `budgets` section of the broker config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetConfig {
    pub max_streams_per_cluster: usize,
    pub max_pending_dials_per_cluster: usize,
    pub max_streams_per_client: usize,
    pub max_pending_dials_per_client: usize,
    pub max_buffered_bytes_per_cluster: u32,
    /// CPU share: while the broker's runtime lags by this much on average (or the host's CPU
    /// pressure exceeds [`CPU_PRESSURE_TARGET`]), a cluster flooding its budgets is paced
    /// ([`FairShare`]). 0 turns pacing off.
    #[serde(with = "humantime_serde")]
    pub cpu_share_lag: Duration,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            max_streams_per_cluster: DEFAULT_MAX_STREAMS_PER_CLUSTER,
            max_pending_dials_per_cluster: DEFAULT_MAX_PENDING_DIALS_PER_CLUSTER,
            max_streams_per_client: DEFAULT_MAX_STREAMS_PER_CLIENT,
            max_pending_dials_per_client: DEFAULT_MAX_PENDING_DIALS_PER_CLIENT,
            max_buffered_bytes_per_cluster: DEFAULT_MAX_BUFFERED_BYTES_PER_CLUSTER,
            cpu_share_lag: DEFAULT_CPU_SHARE_LAG,
        }
    }
}

impl BudgetConfig {
    /// Checks ranges; `stream_window` is `tunnel.stream_window_bytes` (one stream's window must
    /// fit in the cluster's buffer).
    pub fn validate(&self, stream_window: u32) -> Result<(), ConfigError> {
        for (name, v) in [
            (
                "budgets.max_streams_per_cluster",
                self.max_streams_per_cluster,
            ),
            (
                "budgets.max_pending_dials_per_cluster",
                self.max_pending_dials_per_cluster,
            ),
            (
                "budgets.max_streams_per_client",
                self.max_streams_per_client,
            ),
            (
                "budgets.max_pending_dials_per_client",
                self.max_pending_dials_per_client,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(name, "must be at least 1"));
            }
        }
        if self.cpu_share_lag > Duration::from_secs(1) {
            return Err(ConfigError::invalid(
                "budgets.cpu_share_lag",
                "must be at most 1s (0 turns the CPU share off)",
            ));
        }
        if !(stream_window..=MAX_WINDOW).contains(&self.max_buffered_bytes_per_cluster) {
            return Err(ConfigError::invalid(
                "budgets.max_buffered_bytes_per_cluster",
                format!("must be between tunnel.stream_window_bytes ({stream_window}) and 2^31-1"),
            ));
        }
        Ok(())
    }
}

/// A budget refusal is answered after this pause: a client that redials at once (a flood) is
/// slowed to one attempt per pause per connection instead of spinning the broker's CPU on
/// refusals. Bounded cost: the refused connection's task is held that long.
pub const REFUSAL_PAUSE: Duration = Duration::from_millis(100);

/// `Retry-After` (seconds) on every HTTP answer to a dial refused for capacity
/// ([`DialErrorKind::Overloaded`]; see [`retry_after`]); the rule and its reasons live in
/// [`tether_tunnel::wire::RETRY_AFTER_SECS`], shared with the SDK.
pub use tether_tunnel::wire::RETRY_AFTER_SECS;

/// The `Retry-After` seconds an HTTP answer to `e` carries: [`RETRY_AFTER_SECS`] for a refusal
/// for capacity, none for anything a retry a second later would not mend
/// ([`DialErrorKind::retry_after`]).
pub fn retry_after(e: &DialError) -> Option<u16> {
    e.kind.retry_after()
}

/// Start of every budget refusal's message.
pub const REFUSAL_PREFIX: &str = "fairness budget exhausted";

/// Whether `e` is a refusal by a fairness budget (the service proxy answers it 429).
pub fn is_budget_error(e: &DialError) -> bool {
    e.kind == DialErrorKind::Overloaded && e.message.starts_with(REFUSAL_PREFIX)
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    pending: usize,
    open: usize,
}

impl Usage {
    fn streams(self) -> usize {
        self.pending + self.open
    }
}

/// Per-cluster and per-client usage of one broker.
pub struct Budgets {
    cfg: BudgetConfig,
    broker: String,
    clusters: Mutex<HashMap<String, Usage>>,
    clients: Mutex<HashMap<String, Usage>>,
    rejections: prometheus::IntCounterVec,
    share: Option<Arc<FairShare>>,
}

impl std::fmt::Debug for Budgets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budgets")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// Which usage map an entry lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Cluster,
    Client,
}

/// A budget a dial would exceed: its metric label, config key, limit and what it counts.
struct Exceeded {
    budget: &'static str,
    key: &'static str,
    limit: usize,
    what: &'static str,
}

impl Budgets {
    /// `rejections` is `tether_broker_budget_rejections_total{budget,owner}`.
    pub fn new(
        cfg: BudgetConfig,
        broker: impl Into<String>,
        rejections: prometheus::IntCounterVec,
    ) -> Arc<Self> {
        Self::build(cfg, broker.into(), rejections, None)
    }

    /// [`Budgets::new`] with the CPU share on (when `cfg.cpu_share_lag` is not zero); spawns
    /// its controller on the current runtime.
    pub fn with_share(
        cfg: BudgetConfig,
        broker: impl Into<String>,
        rejections: prometheus::IntCounterVec,
        paced: prometheus::IntGauge,
    ) -> Arc<Self> {
        let share = (!cfg.cpu_share_lag.is_zero()).then(|| {
            let s = FairShare::new(cfg.cpu_share_lag, paced);
            tokio::spawn(Arc::clone(&s).run());
            s
        });
        Self::build(cfg, broker.into(), rejections, share)
    }

    fn build(
        cfg: BudgetConfig,
        broker: String,
        rejections: prometheus::IntCounterVec,
        share: Option<Arc<FairShare>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            broker,
            clusters: Mutex::default(),
            clients: Mutex::default(),
            rejections,
            share,
        })
    }

    /// The pacer of a stream to `cluster` (a no-op when the CPU share is off).
    pub fn pacer(&self, cluster: &str) -> Pacer {
        self.share
            .as_ref()
            .map(|s| s.pacer(cluster))
            .unwrap_or_default()
    }

    pub fn config(&self) -> &BudgetConfig {
        &self.cfg
    }

    fn map(&self, scope: Scope) -> std::sync::MutexGuard<'_, HashMap<String, Usage>> {
        let m = match scope {
            Scope::Cluster => &self.clusters,
            Scope::Client => &self.clients,
        };
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a dial to `cluster` for `client` (None: a stream the broker opens itself, e.g. a
    /// peer's relay, counted against the cluster only). `known_cluster` says whether the
    /// cluster has a tunnel here (only then is it named in the rejection metric).
    pub fn admit(
        self: &Arc<Self>,
        cluster: &str,
        client: Option<&str>,
        known_cluster: bool,
    ) -> Result<Admission, DialError> {
        {
            let mut clusters = self.map(Scope::Cluster);
            let u = clusters.get(cluster).copied().unwrap_or_default();
            if let Some(e) = self.exceeded(Scope::Cluster, u) {
                drop(clusters);
                let owner = if known_cluster { cluster } else { "other" };
                self.rejections.with_label_values(&[e.budget, owner]).inc();
                if let Some(s) = &self.share {
                    s.mark_flooding(cluster);
                }
                return Err(self.refusal("cluster", cluster, &e));
            }
            if let Some(client) = client {
                let mut clients = self.map(Scope::Client);
                let v = clients.get(client).copied().unwrap_or_default();
                if let Some(e) = self.exceeded(Scope::Client, v) {
                    drop(clients);
                    drop(clusters);
                    self.rejections.with_label_values(&[e.budget, client]).inc();
                    return Err(self.refusal("client", client, &e));
                }
                clients.entry(client.to_owned()).or_default().pending += 1;
            }
            clusters.entry(cluster.to_owned()).or_default().pending += 1;
        }
        Ok(Admission {
            budgets: Arc::clone(self),
            cluster: cluster.to_owned(),
            client: client.map(str::to_owned),
            open: false,
        })
    }

    /// The budget of `scope` that one more dial would exceed with usage `u`, if any.
    fn exceeded(&self, scope: Scope, u: Usage) -> Option<Exceeded> {
        let c = &self.cfg;
        let (streams, pending) = match scope {
            Scope::Cluster => (
                Exceeded {
                    budget: "cluster_streams",
                    key: "max_streams_per_cluster",
                    limit: c.max_streams_per_cluster,
                    what: "streams open or dialling",
                },
                Exceeded {
                    budget: "cluster_pending_dials",
                    key: "max_pending_dials_per_cluster",
                    limit: c.max_pending_dials_per_cluster,
                    what: "dials waiting for its agent",
                },
            ),
            Scope::Client => (
                Exceeded {
                    budget: "client_streams",
                    key: "max_streams_per_client",
                    limit: c.max_streams_per_client,
                    what: "streams open or dialling",
                },
                Exceeded {
                    budget: "client_pending_dials",
                    key: "max_pending_dials_per_client",
                    limit: c.max_pending_dials_per_client,
                    what: "dials waiting for an answer",
                },
            ),
        };
        if u.streams() >= streams.limit {
            Some(streams)
        } else if u.pending >= pending.limit {
            Some(pending)
        } else {
            None
        }
    }

    /// The refusal answered to a dial that would exceed `e` for `who` (`cluster` or `client`)
    /// `name`: names the budget, its limit and the config key.
    fn refusal(&self, who: &str, name: &str, e: &Exceeded) -> DialError {
        DialError::new(
            DialErrorKind::Overloaded,
            format!(
                "{REFUSAL_PREFIX}: {who} {name:?} already has {limit} {what} on broker {} (budgets.{key} = {limit}); retry later",
                self.broker,
                limit = e.limit,
                what = e.what,
                key = e.key,
            ),
        )
    }

    /// Current (pending, open) of a cluster, for tests and `/debug`.
    pub fn cluster_usage(&self, cluster: &str) -> (usize, usize) {
        let u = self
            .map(Scope::Cluster)
            .get(cluster)
            .copied()
            .unwrap_or_default();
        (u.pending, u.open)
    }

    /// Entries held (clusters + clients with streams now); idle ones are removed.
    pub fn entries(&self) -> usize {
        self.map(Scope::Cluster).len() + self.map(Scope::Client).len()
    }

    fn update(&self, scope: Scope, key: &str, f: impl FnOnce(&mut Usage)) {
        let mut m = self.map(scope);
        if let Some(u) = m.get_mut(key) {
            f(u);
            if u.streams() == 0 {
                m.remove(key);
            }
        }
    }
}

/// One admitted stream's hold on its budgets: a pending dial until [`Admission::opened`], an
/// open stream after; released on drop.
#[derive(Debug)]
pub struct Admission {
    budgets: Arc<Budgets>,
    cluster: String,
    client: Option<String>,
    open: bool,
}

impl Admission {
    /// The agent answered: the dial becomes an open stream.
    pub fn opened(&mut self) {
        if self.open {
            return;
        }
        self.open = true;
        let moved = |u: &mut Usage| {
            u.pending -= 1;
            u.open += 1;
        };
        self.budgets.update(Scope::Cluster, &self.cluster, moved);
        if let Some(c) = &self.client {
            self.budgets.update(Scope::Client, c, moved);
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let open = self.open;
        let release = |u: &mut Usage| {
            if open {
                u.open -= 1;
            } else {
                u.pending -= 1;
            }
        };
        self.budgets.update(Scope::Cluster, &self.cluster, release);
        if let Some(c) = &self.client {
            self.budgets.update(Scope::Client, c, release);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// CPU share: pacing the heaviest cluster while the broker is contended.
// ---------------------------------------------------------------------------------------------

/// Period of the share controller: bytes are counted per cluster over it, limits set for the
/// next.
pub const SHARE_PERIOD: Duration = Duration::from_millis(50);
/// Tick of the runtime-lag probe (how late a timer fires tells how busy the broker is).
const LAG_TICK: Duration = Duration::from_millis(5);
/// Smallest allowance of a paced cluster per period (512 KiB per 50 ms: 10 MiB/s).
pub const MIN_SHARE_BYTES: u64 = 512 << 10;
/// Periods a cluster counts as flooding after a budget refused it (2 s).
const FLOODING_PERIODS: u64 = 40;
/// Periods (2 s) the CPU must stay free before the broker counts as uncontended again.
/// On a quiet host contention comes in bursts — the other clusters' requests and transfers —
/// and a paced flood that grew back in every quiet gap between them (a quarter more per 50 ms
/// period: unpaced again within ~0.5 s) would be at full speed when the next burst arrives and
/// take its CPU until the controller notices again (the likely cause of the victims' 80–102 %
/// throughput on a quiet machine; on a loaded one the CPU is contended all along and the flood
/// stays at 10 MiB/s while they are measured).
pub const CALM_PERIODS: u64 = 40;
/// Periods (1 s) a cluster must move most of the broker's bytes, while the CPU is contended and
/// other clusters hold streams, to count as flooding without any budget refusal (a flood that
/// stays within its stream budget but pushes bytes). A burst — one transfer of a few MiB — is
/// shorter and is never paced.
pub const SUSTAINED_HEAVY_PERIODS: u64 = 20;
/// Bytes per period below which a cluster never counts as heavy (the paced rate: a paced
/// cluster using all of its allowance stays heavy).
const HEAVY_MIN_BYTES: u64 = MIN_SHARE_BYTES;

/// Longest single pause of a paced stream (a stream's write-stall timeout is far longer).
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// Bytes one cluster moved in the current period, and what it may move while paced.
#[derive(Debug)]
pub struct ClusterRate {
    bytes: AtomicU64,
    /// Bytes per period; `u64::MAX`: not paced.
    limit: AtomicU64,
    /// Periods left during which the cluster counts as flooding (it exhausted a budget).
    flooding: AtomicU64,
    /// Consecutive periods the cluster was heavy (see [`SUSTAINED_HEAVY_PERIODS`]).
    heavy: AtomicU64,
    /// Virtual clock of a paced cluster (µs since `epoch`): when its last scheduled byte is due.
    clock: AtomicU64,
    epoch: Instant,
}

impl ClusterRate {
    fn now_micros(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

impl Default for ClusterRate {
    fn default() -> Self {
        Self {
            bytes: AtomicU64::new(0),
            limit: AtomicU64::new(u64::MAX),
            flooding: AtomicU64::new(0),
            heavy: AtomicU64::new(0),
            clock: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// A stream's handle on its cluster's share: [`Pacer::charge`] after moving bytes.
#[derive(Debug, Clone, Default)]
pub struct Pacer(Option<Arc<ClusterRate>>);

impl Pacer {
    /// Counts `n` bytes; pauses the stream when its cluster is over its allowance (only while
    /// the broker is contended and other clusters are active).
    pub async fn charge(&self, n: usize) {
        if let Some(d) = self.pause_for(n) {
            tokio::time::sleep(d).await;
        }
    }

    /// [`Pacer::charge`] without the sleep: how long to pause, if at all.
    pub fn pause_for(&self, n: usize) -> Option<Duration> {
        let r = self.0.as_ref()?;
        r.bytes.fetch_add(n as u64, Ordering::Relaxed);
        let limit = r.limit.load(Ordering::Relaxed);
        if limit == u64::MAX {
            return None;
        }
        // A paced cluster's bytes are scheduled on one virtual clock at `limit` bytes per
        // period (all its streams share it): each chunk takes its slot, and the stream waits
        // for it beyond a burst of one period.
        let cost = u64::try_from(
            (u128::from(n as u64) * SHARE_PERIOD.as_micros()) / u128::from(limit.max(1)),
        )
        .unwrap_or(u64::MAX);
        let now = r.now_micros();
        let mut slot_end = 0;
        let _ = r
            .clock
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |vt| {
                slot_end = vt.max(now).saturating_add(cost);
                Some(slot_end)
            });
        let burst = u64::try_from(SHARE_PERIOD.as_micros()).unwrap_or(u64::MAX);
        let wait = slot_end.saturating_sub(now).saturating_sub(burst);
        (wait > 0).then(|| Duration::from_micros(wait).min(MAX_PAUSE))
    }
}

/// A client-side reader whose chunks are charged to the cluster's share.
pub struct PacedReader<R> {
    inner: R,
    pacer: Pacer,
}

impl<R> PacedReader<R> {
    pub fn new(inner: R, pacer: Pacer) -> Self {
        Self { inner, pacer }
    }
}

impl<R: ChunkReader> ChunkReader for PacedReader<R> {
    async fn next_chunk(&mut self) -> std::io::Result<Option<Bytes>> {
        let c = self.inner.next_chunk().await?;
        if let Some(b) = &c {
            self.pacer.charge(b.len()).await;
        }
        Ok(c)
    }
}

/// [`Pacer`] for byte loops written as `poll_*` functions: [`PollPacer::charge`] after moving
/// bytes, and [`PollPacer::poll_ready`] before moving more (pending while the stream pauses).
#[derive(Debug, Default)]
pub struct PollPacer {
    pacer: Pacer,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl PollPacer {
    pub fn new(pacer: Pacer) -> Self {
        Self { pacer, pause: None }
    }

    /// Ready once the pause of the last charge (if any) is over.
    pub fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        if let Some(p) = self.pause.as_mut() {
            ready!(p.as_mut().poll(cx));
            self.pause = None;
        }
        Poll::Ready(())
    }

    /// Counts `n` bytes; the next [`PollPacer::poll_ready`] waits if the cluster is over its
    /// allowance.
    pub fn charge(&mut self, n: usize) {
        if let Some(d) = self.pacer.pause_for(n) {
            self.pause = Some(Box::pin(tokio::time::sleep(d)));
        }
    }
}

/// A client-side writer whose writes are charged to the cluster's share (a paused write
/// holds the stream's window, so the agent is paced too).
pub struct PacedWriter<W> {
    inner: W,
    pace: PollPacer,
}

impl<W> PacedWriter<W> {
    pub fn new(inner: W, pacer: Pacer) -> Self {
        Self {
            inner,
            pace: PollPacer::new(pacer),
        }
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for PacedWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        ready!(me.pace.poll_ready(cx));
        let r = ready!(Pin::new(&mut me.inner).poll_write(cx, buf));
        if let Ok(n) = &r {
            me.pace.charge(*n);
        }
        Poll::Ready(r)
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<W: AbortableWrite> AbortableWrite for PacedWriter<W> {
    fn abort(&mut self) {
        self.inner.abort();
    }
}

/// Share of a period during which some task of the host waited for a CPU (Linux PSI
/// `/proc/pressure/cpu`, "some") above which the broker counts as contended.
pub const CPU_PRESSURE_TARGET: f64 = 0.2;

/// Cumulative µs some task waited for a CPU (`/proc/pressure/cpu`), if the kernel reports it.
fn cpu_pressure_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
}

/// Broker-wide byte-rate shares: while the CPU is contended — the broker's runtime lags
/// `budgets.cpu_share_lag`, or the host's CPU pressure (PSI) exceeds [`CPU_PRESSURE_TARGET`] —
/// a cluster that floods (exhausts a budget while other clusters hold streams, see
/// [`FairShare::adjust`]) is paced to [`MIN_SHARE_BYTES`] per period; its limit grows back and
/// is lifted once it stops. Other clusters are never paced, so one cluster's flood cannot take
/// the CPU the others need.
pub struct FairShare {
    clusters: Mutex<HashMap<String, Arc<ClusterRate>>>,
    /// Runtime lag above which the broker counts as contended.
    lag_target: Duration,
    lag_micros: AtomicU64,
    /// Consecutive periods without contention.
    calm: AtomicU64,
    paced: prometheus::IntGauge,
}

impl std::fmt::Debug for FairShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FairShare")
            .field("lag_target", &self.lag_target)
            .finish_non_exhaustive()
    }
}

impl FairShare {
    /// `paced` is `tether_broker_paced_clusters`. Spawn [`FairShare::run`] to activate it.
    pub fn new(lag_target: Duration, paced: prometheus::IntGauge) -> Arc<Self> {
        Arc::new(Self {
            clusters: Mutex::default(),
            lag_target,
            lag_micros: AtomicU64::new(0),
            calm: AtomicU64::new(CALM_PERIODS),
            paced,
        })
    }

    /// The pacer of a stream to `cluster`.
    pub fn pacer(&self, cluster: &str) -> Pacer {
        let mut m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        Pacer(Some(Arc::clone(m.entry(cluster.to_owned()).or_default())))
    }

    /// Clusters some stream holds (pacing needs two).
    fn clusters_present(&self) -> usize {
        let m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        m.values().filter(|r| Arc::strong_count(r) > 1).count()
    }

    /// Mean runtime lag of the last period.
    pub fn lag(&self) -> Duration {
        Duration::from_micros(self.lag_micros.load(Ordering::Relaxed))
    }

    /// A budget refused `cluster`: it counts as flooding for the next [`FLOODING_PERIODS`].
    pub fn mark_flooding(&self, cluster: &str) {
        let m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = m.get(cluster) {
            r.flooding.store(FLOODING_PERIODS, Ordering::Relaxed);
        }
    }

    /// The controller loop (runs until the broker stops).
    pub async fn run(self: Arc<Self>) {
        let mut pressure_before = cpu_pressure_total();
        loop {
            if self.clusters_present() <= 1 {
                // Nothing to share between (pacing needs another cluster holding streams): no
                // lag probe, which would wake the broker every LAG_TICK and cost the data path
                // latency on an idle or single-cluster broker.
                tokio::time::sleep(SHARE_PERIOD).await;
                pressure_before = cpu_pressure_total();
                self.adjust(false);
                continue;
            }
            // Measure how late LAG_TICK timers fire over one period.
            let started = Instant::now();
            let (mut lag, mut ticks) = (Duration::ZERO, 0u32);
            while started.elapsed() < SHARE_PERIOD {
                let t = Instant::now();
                tokio::time::sleep(LAG_TICK).await;
                lag += t.elapsed().saturating_sub(LAG_TICK);
                ticks += 1;
            }
            let lag = lag / ticks.max(1);
            self.lag_micros.store(
                u64::try_from(lag.as_micros()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            // Runnable tasks of the host waiting for a CPU (Linux PSI) over the same period:
            // the flood's agent and clients compete for the cores outside this process too.
            let stalled = cpu_pressure_total();
            let pressure = match (pressure_before, stalled) {
                (Some(a), Some(b)) => {
                    b.saturating_sub(a) as f64 / started.elapsed().as_micros().max(1) as f64
                }
                _ => 0.0,
            };
            pressure_before = stalled;
            self.adjust(lag >= self.lag_target || pressure >= CPU_PRESSURE_TARGET);
        }
    }

    /// One control step (public for tests): `contended` says whether the CPU was contended
    /// this period; the broker counts as contended until [`CALM_PERIODS`] in a row were not.
    ///
    /// A cluster *floods* while a budget refused it in the last 2 s, or after it was *heavy*
    /// for [`SUSTAINED_HEAVY_PERIODS`] in a row — it moved more than half of the broker's bytes
    /// of a contended period (at least [`MIN_SHARE_BYTES`]), or, while paced, used at least
    /// half of its allowance — and another cluster holds streams on this broker. While the CPU is
    /// contended a flooding cluster is paced to
    /// [`MIN_SHARE_BYTES`] per period at once; other clusters are never paced. A paced cluster
    /// that no longer floods (or once the CPU is free) gets a quarter more per period, and the
    /// limit is lifted once it uses under half of it.
    pub fn adjust(&self, contended: bool) {
        let calm = if contended {
            self.calm.store(0, Ordering::Relaxed);
            0
        } else {
            self.calm.fetch_add(1, Ordering::Relaxed).saturating_add(1)
        };
        let contended = calm < CALM_PERIODS;
        let mut m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        // Forget clusters no stream holds any more.
        m.retain(|_, r| Arc::strong_count(r) > 1);
        let present = m.len();
        let rates: Vec<(String, Arc<ClusterRate>, u64)> = m
            .iter()
            .map(|(name, r)| {
                (
                    name.clone(),
                    Arc::clone(r),
                    r.bytes.swap(0, Ordering::Relaxed),
                )
            })
            .collect();
        drop(m);
        let total: u64 = rates.iter().map(|(_, _, b)| *b).sum();
        let mut paced = 0;
        for (cluster, r, bytes) in rates {
            let limit = r.limit.load(Ordering::Relaxed);
            let heavy = present > 1
                && bytes >= HEAVY_MIN_BYTES
                && if limit == u64::MAX {
                    contended && bytes.saturating_mul(2) > total
                } else {
                    // Paced: using at least half of its allowance, i.e. still pushing.
                    bytes.saturating_mul(2) >= limit
                };
            let heavy_for = if heavy {
                r.heavy.fetch_add(1, Ordering::Relaxed) + 1
            } else {
                r.heavy.store(0, Ordering::Relaxed);
                0
            };
            if heavy_for >= SUSTAINED_HEAVY_PERIODS {
                r.flooding.store(FLOODING_PERIODS, Ordering::Relaxed);
            }
            let flooding = r
                .flooding
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |f| f.checked_sub(1))
                .is_ok()
                && present > 1;
            let next = if contended && flooding {
                MIN_SHARE_BYTES
            } else if limit == u64::MAX {
                u64::MAX
            } else {
                let grown = limit.saturating_add(limit / 4);
                if bytes.saturating_mul(2) < grown {
                    u64::MAX
                } else {
                    grown
                }
            };
            r.limit.store(next, Ordering::Relaxed);
            if (next == u64::MAX) != (limit == u64::MAX) {
                tracing::info!(
                    %cluster,
                    paced = next != u64::MAX,
                    bytes_per_period = bytes,
                    "CPU share: cluster pacing changed"
                );
            }
            if next != u64::MAX {
                paced += 1;
            }
        }
        self.paced.set(paced);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(cfg: BudgetConfig) -> (Arc<Budgets>, prometheus::IntCounterVec) {
        let m =
            prometheus::IntCounterVec::new(prometheus::Opts::new("r", "r"), &["budget", "owner"])
                .unwrap();
        (Budgets::new(cfg, "b1", m.clone()), m)
    }

    #[test]
    fn cluster_and_client_budgets_refuse_with_their_name_and_limit() {
        let (b, m) = budgets(BudgetConfig {
            max_streams_per_cluster: 3,
            max_pending_dials_per_cluster: 2,
            max_streams_per_client: 4,
            max_pending_dials_per_client: 10,
            ..Default::default()
        });
        let mut a1 = b.admit("c1", Some("ops"), true).unwrap();
        let _a2 = b.admit("c1", Some("ops"), true).unwrap();
        let e = b.admit("c1", Some("ops"), true).unwrap_err();
        assert_eq!(e.kind, DialErrorKind::Overloaded);
        assert!(
            e.message.contains("max_pending_dials_per_cluster = 2") && e.message.contains("\"c1\""),
            "{e}"
        );
        a1.opened();
        let _a3 = b.admit("c1", Some("ops"), true).unwrap();
        let e = b.admit("c1", None, true).unwrap_err();
        assert!(e.message.contains("max_streams_per_cluster = 3"), "{e}");
        // Another cluster is not affected, but the client's own budget is.
        let _a4 = b.admit("c2", Some("ops"), true).unwrap();
        let e = b.admit("c2", Some("ops"), false).unwrap_err();
        assert!(
            e.message.contains("client \"ops\"")
                && e.message.contains("max_streams_per_client = 4"),
            "{e}"
        );
        let _a5 = b.admit("c2", Some("other-client"), true).unwrap();
        assert_eq!(
            m.with_label_values(&["cluster_pending_dials", "c1"]).get(),
            1
        );
        assert_eq!(m.with_label_values(&["cluster_streams", "c1"]).get(), 1);
        assert_eq!(m.with_label_values(&["client_streams", "ops"]).get(), 1);
        // Releasing frees the budget and idle entries are dropped.
        drop((a1, _a2, _a3, _a4, _a5));
        assert_eq!(b.cluster_usage("c1"), (0, 0));
        assert_eq!(b.entries(), 0);
    }

    #[test]
    fn unknown_clusters_share_one_metric_series() {
        let (b, m) = budgets(BudgetConfig {
            max_streams_per_cluster: 1,
            ..Default::default()
        });
        let _a = b.admit("made-up-1", None, false).unwrap();
        assert!(b.admit("made-up-1", None, false).is_err());
        assert_eq!(m.with_label_values(&["cluster_streams", "other"]).get(), 1);
    }

    #[test]
    fn validation_names_the_field() {
        let mut c = BudgetConfig {
            max_pending_dials_per_client: 0,
            ..Default::default()
        };
        let e = c.validate(4 << 20).unwrap_err().to_string();
        assert!(e.contains("budgets.max_pending_dials_per_client"), "{e}");
        c.max_pending_dials_per_client = 1;
        c.max_buffered_bytes_per_cluster = 1 << 20;
        let e = c.validate(4 << 20).unwrap_err().to_string();
        assert!(e.contains("budgets.max_buffered_bytes_per_cluster"), "{e}");
    }
}

#[cfg(test)]
mod share_tests {
    use super::*;

    fn share() -> Arc<FairShare> {
        FairShare::new(
            Duration::from_millis(1),
            prometheus::IntGauge::new("p", "p").unwrap(),
        )
    }

    #[test]
    fn a_flooding_cluster_is_paced_and_a_light_one_is_not() {
        let s = share();
        let (flood, light) = (s.pacer("flood"), s.pacer("light"));
        // Both active, the flood at 40× the light one's bytes and refused by a budget.
        for _ in 0..40 {
            let _ = flood.pause_for(8 << 20);
            let _ = light.pause_for(200 << 10);
            s.mark_flooding("flood");
            s.adjust(true);
        }
        assert!(
            light.pause_for(1 << 20).is_none(),
            "the light cluster is never paced"
        );
        // The flood's chunks now wait for their slots: 16 chunks of 256 KiB at the minimum
        // share take 16 × 256 KiB / MIN_SHARE_BYTES periods.
        let waits: Vec<Duration> = (0..16).filter_map(|_| flood.pause_for(256 << 10)).collect();
        assert!(!waits.is_empty(), "the flood is paced");
        let last = *waits.last().unwrap();
        let expected =
            SHARE_PERIOD.mul_f64(16.0 * (256 << 10) as f64 / MIN_SHARE_BYTES as f64) - SHARE_PERIOD;
        assert!(
            last + Duration::from_millis(20) >= expected.min(MAX_PAUSE),
            "last wait {last:?}, expected about {expected:?}"
        );
        // A light cluster moving many bytes for a burst shorter than SUSTAINED_HEAVY_PERIODS
        // (not refused by any budget) is still not paced.
        for _ in 0..SUSTAINED_HEAVY_PERIODS / 2 {
            let _ = light.pause_for(64 << 20);
            s.adjust(true);
        }
        assert!(light.pause_for(1 << 20).is_none(), "only floods are paced");
        // A quiet gap shorter than CALM_PERIODS between the others' bursts does not lift it.
        for _ in 0..CALM_PERIODS - 1 {
            let _ = flood.pause_for(MIN_SHARE_BYTES as usize);
            s.mark_flooding("flood");
            s.adjust(false);
        }
        assert!(
            flood.pause_for(1 << 20).is_some(),
            "still paced in a short calm gap"
        );
        // Without contention the limit grows back and is lifted.
        for _ in 0..200 {
            s.adjust(false);
        }
        assert!(flood.pause_for(1 << 20).is_none(), "lifted");
    }

    #[test]
    fn a_byte_flood_within_its_budgets_is_paced_once_sustained() {
        let s = share();
        let (flood, light) = (s.pacer("flood"), s.pacer("light"));
        // Never refused by a budget, but most of the broker's bytes, period after period.
        for i in 0..SUSTAINED_HEAVY_PERIODS {
            assert!(
                flood.pause_for(8 << 20).is_none(),
                "paced too early, period {i}"
            );
            let _ = light.pause_for(64 << 10);
            s.adjust(true);
        }
        assert!(
            flood.pause_for(8 << 20).is_some(),
            "a sustained byte flood is paced"
        );
        assert!(
            light.pause_for(1 << 20).is_none(),
            "the light cluster is not"
        );
        // Still pushing at its paced rate: it stays paced while the CPU is contended.
        for _ in 0..2 * FLOODING_PERIODS {
            let _ = flood.pause_for(MIN_SHARE_BYTES as usize);
            s.adjust(true);
        }
        assert!(flood.pause_for(1 << 20).is_some(), "still paced");
        // Without contention (nor bytes) the limit grows back and is lifted.
        for _ in 0..200 {
            s.adjust(false);
        }
        assert!(flood.pause_for(1 << 20).is_none(), "lifted");
        // Without contention a heavy cluster is never marked.
        for _ in 0..2 * SUSTAINED_HEAVY_PERIODS {
            let _ = flood.pause_for(8 << 20);
            s.adjust(false);
        }
        s.adjust(true);
        assert!(
            flood.pause_for(8 << 20).is_none(),
            "not heavy while uncontended"
        );
    }

    #[test]
    fn a_flood_alone_on_the_broker_is_not_paced() {
        let s = share();
        let flood = s.pacer("flood");
        for _ in 0..10 {
            let _ = flood.pause_for(8 << 20);
            s.mark_flooding("flood");
            s.adjust(true);
        }
        assert!(flood.pause_for(8 << 20).is_none(), "nobody to yield to");
    }
}
