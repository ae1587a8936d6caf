//! Rust client for the tunnel-broker's native gRPC Dial API.
//!
//! - [`Dialer`]: a connection (over TLS, or without TLS to the broker's plain client port with a
//!   bearer token) to a broker; [`Dialer::dial`] opens a TCP connection to a target inside a
//!   managed cluster and returns a [`DialStream`] that implements `AsyncRead + AsyncWrite`.
//!   Many streams share a connection; [`Dialer::connect`] opens more connections on demand
//!   (while every open one carries a stream, up to the CPUs), [`Dialer::connect_pool`] opens a
//!   fixed number at once; each new stream goes on the least busy one. [`DialStream::send`] /
//!   [`DialStream::poll_recv`] move owned `Bytes` without the copy that `AsyncWrite`/`AsyncRead` make (used by `tetherctl proxy connect`).
//! - [`Dialer::kube_client`]: a `kube::Client` for a cluster whose every connection goes
//!   through the tunnel to that cluster's API server (TLS to the API server end to end, with
//!   the kubeconfig's CA and credentials).
//!
//! Protocol: [`Dialer::dial`] uses `tether-dial/1` (module `mux`: the frames of the broker ↔
//! agent multiplexer `tether-tunnel/2` between client and broker, ALPN `tether-dial/1` on
//! `https://`, a preface on `http://`; a write is framed and written by the writing task, no
//! HTTP/2 in between). Against a broker that does not speak it, the broker's unframed Dial
//! (`DialRaw`: the dial in request headers, the connection's bytes as plain HTTP/2 DATA, no
//! protobuf message per chunk and no extra copies), and the framed gRPC `Dial` RPC where that is
//! not served either (an older broker); [`Dialer::dial_framed`] always uses the framed RPC. The
//! unframed Dial runs on h2 directly (module `raw`: no body pipe task or body adapters between a
//! stream and h2); the framed one on a tonic channel opened on first use.
//! [`DialStream::protocol`] tells which one a stream uses.
//!
//! Allocator: h2 (below the SDK) allocates a buffer per DATA frame it receives, up to
//! [`MAX_FRAME_BYTES`]; glibc's allocator trims and re-faults such buffers, which cost the SDK's
//! receive side 5–15 % more CPU per GB in `tether-bench` (docs/benchmarks.md). An application
//! that moves bulk data through the SDK should use mimalloc (as `tetherctl` does, with
//! `tether_runtime::data_plane_allocator!()`), or run with
//! `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576:glibc.malloc.trim_threshold=16777216`.
//!
//! Semantics: `shutdown()` on a [`DialStream`] half-closes (the target sees EOF, its reply still
//! arrives); a stream that breaks yields an `io::Error` (`ConnectionReset`), never a clean EOF;
//! dropping a stream without shutdown aborts it: its HTTP/2 stream is reset (an `abort` frame on
//! the framed Dial), and the broker resets the target's connection (ending the request stream
//! would read as EOF there).

#![forbid(unsafe_code)]

mod mux;
mod opener;
mod raw;

pub use raw::{KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, SEND_BUFFER_BYTES};

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures::{Stream, StreamExt as _};
use tether_proto::tunnel::v1 as pb;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Frames queued towards the broker per stream on the framed Dial before writes wait (at most 2
/// × [`MAX_FRAME_BYTES`] per stream beyond its HTTP/2 window; the unframed Dial bounds its queue
/// inside h2, [`SEND_BUFFER_BYTES`]). With 8, eight busy streams on one
/// connection could queue 16 MiB, and `tetherctl proxy connect` ran 8 streams at 0.5× the speed
/// of one; with 2, 0.88× (docs/benchmarks.md, issue 16).
pub const SEND_QUEUE_FRAMES: usize = 2;
/// Largest data frame sent.
pub const MAX_FRAME_BYTES: usize = 256 * 1024;

/// Writes up to this size are copied into a right-sized buffer; larger ones into a pooled
/// [`MAX_FRAME_BYTES`] buffer ([`ChunkPool`]).
pub const COPY_BELOW: usize = 16 * 1024;
/// Buffers a [`ChunkPool`] keeps for reuse (more are freed when they come back): the framed
/// Dial's send queue, the chunk h2 is writing, and one being filled.
pub const POOLED_CHUNKS: usize = SEND_QUEUE_FRAMES + 2;

/// How long a stream dropped after `shutdown()` (before the target's EOF) keeps its call open
/// so that everything written before `shutdown()` still reaches the target.
pub const LINGER_AFTER_SHUTDOWN: Duration = Duration::from_secs(30);
/// The HTTP/2 stream window this client advertises (bytes the broker may send ahead per
/// stream).
pub const STREAM_WINDOW_BYTES: u32 = 4 << 20;
/// Most bytes from the target a stream dropped after `shutdown()` reads (and discards) while it
/// lingers, besides [`LINGER_AFTER_SHUTDOWN`]; past it the stream is aborted. The linger is there
/// for the bytes going out: a target that keeps sending (a log follower, a watch) would
/// otherwise stream into the tunnel for the whole linger, for a reader that is gone. One
/// stream window.
pub const LINGER_MAX_BYTES: usize = STREAM_WINDOW_BYTES as usize;

/// A bearer token. `Debug` never shows it.
#[derive(Clone)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Client certificate and key in PEM. `Debug` never shows the key.
#[derive(Clone)]
pub struct ClientCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for ClientCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientCert(<redacted>)")
    }
}

/// How to reach a broker.
#[derive(Debug, Clone)]
pub struct DialerConfig {
    /// `https://host:port` of the broker's client TLS listener, or `http://host:port` of its
    /// plain client listener (HTTP/2 without TLS, a bearer token only: for a client on the
    /// broker's host or on a network that already protects its traffic, as plain CONNECT).
    pub endpoint: String,
    /// Name expected in the broker's certificate (unused with `http://`).
    pub server_name: String,
    /// CA bundle (PEM) that signed the broker's certificate (unused with `http://`).
    pub ca_pem: String,
    pub client_cert: Option<ClientCert>,
    pub token: Option<Token>,
    pub connect_timeout: Duration,
}

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid broker endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("cannot connect to broker: {0}")]
    Connect(String),
    /// The broker could not be reached: its TCP connect failed, the connection was reset or
    /// closed before its TLS handshake got an answer (a broker closing its listener), the
    /// connection was not up within the connect timeout, or the broker refused the stream
    /// unprocessed on a new connection too (it drains, or is at its stream limit): nothing was
    /// dialled, so the dial may go to another broker or again later.
    #[error("cannot reach broker: {0}")]
    Unreachable(String),
    /// The TLS handshake failed over a certificate: the broker's was not accepted (CA, name,
    /// validity) or it refused ours. Another protocol on the same port would fail the same way,
    /// so it is not tried.
    #[error("cannot connect to broker: {0}")]
    Certificate(String),
    #[error("token is not a valid header value")]
    BadToken,
    #[error("broker refused the dial ({code:?}): {message}")]
    Dial {
        code: pb::DialErrorCode,
        message: String,
    },
    #[error("broker rejected the request: {0}")]
    Status(#[from] tonic::Status),
    #[error("broker ended the stream before answering the dial")]
    NoAnswer,
    /// Connected, but no answer to the dial came within [`DIAL_ANSWER_TIMEOUT`].
    #[error("broker did not answer the dial within {0:?}")]
    NoAnswerWithin(Duration),
    #[error("broker answered the dial with HTTP {0} and no Tether error")]
    BadAnswer(u16),
    #[error("kube client: {0}")]
    Kube(String),
}

impl ClientError {
    /// How long to wait before the same dial is worth trying again, where the broker asks for a
    /// wait: a dial refused for capacity ([`pb::DialErrorCode::Overloaded`]: a fairness budget,
    /// or the tunnel's stream or pending-dial limit) gives the delay the broker's HTTP answers
    /// carry as `Retry-After` ([`tether_tunnel::wire::RETRY_AFTER_SECS`]), whichever protocol
    /// the dial used. `None` for every other error: nothing a retry a moment later would mend,
    /// or (for [`ClientError::Unreachable`]) a broker that may be gone, for which the caller's
    /// own backoff or another broker is the answer. The SDK itself never retries a refused dial.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Dial {
                code: pb::DialErrorCode::Overloaded,
                ..
            } => Some(Duration::from_secs(
                tether_tunnel::wire::RETRY_AFTER_SECS.into(),
            )),
            _ => None,
        }
    }
}

/// A connection (or a few, see [`Dialer::connect`] and [`Dialer::connect_pool`]) to a broker's
/// native Dial API.
#[derive(Clone)]
pub struct Dialer {
    /// Connection slots: those [`Dialer::connect_pool`] opened, and those [`Dialer::connect`]
    /// opens when a new stream finds every open connection busy.
    slots: Arc<[Slot]>,
    /// For the connections opened on demand.
    cfg: Arc<DialerConfig>,
    /// After a connection on demand failed to open, when the next may be tried.
    retry: Arc<std::sync::Mutex<OnDemandRetry>>,
    /// Where the search for the least busy connection starts (round robin among equals).
    next: Arc<AtomicUsize>,
    token: Option<MetadataValue<Ascii>>,
    /// Cleared once the broker answered `DialRaw` as an unknown gRPC method (an older broker).
    raw: Arc<AtomicBool>,
}

/// One connection of a [`Dialer`] and the streams open on it.
struct Conn {
    /// `tether-dial/1` (`None`: the broker does not speak it; dials go over HTTP/2).
    mux: Option<mux::MuxConn>,
    /// The unframed Dial's connection, driven with h2 directly ([`raw`]).
    raw: raw::RawConn,
    /// The framed gRPC `Dial` (older brokers): a second connection, opened on first use.
    client: pb::dialer_client::DialerClient<Channel>,
}

/// One connection slot of a [`Dialer`]: its connection once opened, and its load.
struct Slot {
    conn: tokio::sync::OnceCell<Conn>,
    /// Open [`DialStream`]s on this slot's connection (each holds a [`ConnLoad`]), and dials
    /// waiting for it to open: concurrent dials that find every open connection busy spread
    /// over the slots being opened instead of all waiting for the first.
    load: Arc<AtomicUsize>,
}

impl Slot {
    fn new(conn: Option<Conn>) -> Self {
        Self {
            conn: tokio::sync::OnceCell::new_with(conn),
            load: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }
}

/// Backoff of connections on demand: after one failed to open, no other is tried before
/// `not_before` (jittered, doubling from [`ON_DEMAND_RETRY_INITIAL`] up to
/// [`ON_DEMAND_RETRY_MAX`] while they keep failing), so that against a broker that refuses
/// connections each dial does not wait for a failed connect before it shares one.
struct OnDemandRetry {
    backoff: tether_backoff::Backoff,
    not_before: Option<std::time::Instant>,
}

impl OnDemandRetry {
    fn new() -> Self {
        Self {
            backoff: tether_backoff::Backoff::new(tether_backoff::BackoffConfig {
                initial: ON_DEMAND_RETRY_INITIAL,
                max: ON_DEMAND_RETRY_MAX,
                // A connection that opened resets it ([`Self::opened`]).
                reset_after: Duration::ZERO,
                ..tether_backoff::BackoffConfig::default()
            }),
            not_before: None,
        }
    }

    fn allowed(&self) -> bool {
        self.not_before
            .is_none_or(|t| std::time::Instant::now() >= t)
    }

    fn failed(&mut self) -> Duration {
        let d = self.backoff.failed();
        self.not_before = Some(std::time::Instant::now() + d);
        d
    }

    fn opened(&mut self) {
        self.backoff.reset();
        self.not_before = None;
    }
}

/// A stream's share of its connection's load (and the connection's index); released on drop.
struct ConnLoad(Arc<AtomicUsize>, usize);

impl Drop for ConnLoad {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Most HTTP/2 connections one [`Dialer`] opens ([`Dialer::connect_pool`]).
pub const MAX_CONNECTIONS: usize = 16;
/// Most connections [`Dialer::connect`] opens on demand (and no more than the CPUs).
pub const MAX_ON_DEMAND_CONNECTIONS: usize = 4;
/// After a connection on demand failed to open, no other is tried for about this long (½ to 1×,
/// jittered), doubling while they keep failing, up to [`ON_DEMAND_RETRY_MAX`].
pub const ON_DEMAND_RETRY_INITIAL: Duration = Duration::from_secs(1);
/// Longest pause of connections on demand after failures.
pub const ON_DEMAND_RETRY_MAX: Duration = Duration::from_secs(60);

/// Path of the unframed Dial (`docs/tunnel-protocol.md`).
pub const RAW_DIAL_PATH: &str = "/tether.tunnel.v1.Dialer/DialRaw";
/// Longest wait for the broker's answer to a dial (brokers cap a dial at 60 s, then answer
/// with a timeout error): past it the broker is taken as wedged and the dial fails, where a
/// connection that merely died is caught by the keepalive sooner.
pub const DIAL_ANSWER_TIMEOUT: Duration = Duration::from_secs(75);

/// The W3C trace context (`traceparent`, `tracestate`) of the caller's current span, sent with
/// every dial so that the broker's and the agent's spans of the stream join the caller's trace.
/// Empty unless the application traces with OpenTelemetry (a `tracing-opentelemetry` layer and a
/// global text-map propagator, as `opentelemetry_sdk`'s `TraceContextPropagator`).
fn trace_context() -> Vec<(String, String)> {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    struct Fields(Vec<(String, String)>);
    impl opentelemetry::propagation::Injector for Fields {
        fn set(&mut self, key: &str, value: String) {
            self.0.push((key.to_owned(), value));
        }
    }
    let cx = tracing::Span::current().context();
    let mut fields = Fields(Vec::new());
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut fields));
    fields.0
}

/// Largest refusal message read from the broker.
const MAX_REFUSAL_BYTES: usize = 16 * 1024;
/// Budget for reading a refusal's message once its head arrived.
const REFUSAL_READ_TIMEOUT: Duration = Duration::from_secs(5);

impl Dialer {
    /// Connects (over TLS for `https://`) to the broker: one connection, and more on demand. A
    /// new stream goes on an open connection without streams; when every open connection
    /// carries one, another is opened, up to the CPUs of this machine (at most
    /// [`MAX_ON_DEMAND_CONNECTIONS`]), and then streams share the least busy one. One stream or
    /// a few in turn (a kube client's requests) keep to one connection; concurrent busy streams
    /// spread over as many connections as there are cores to encrypt and frame them (one
    /// connection is read by one task on the broker: 8 busy streams on one connection ran at
    /// 0.85× the throughput of 8 CONNECTs, on two at 0.95×; docs/benchmarks.md). Dials
    /// started at once spread over the connections being opened (a dial waits for the one it
    /// picked). A connection that cannot be opened on demand is not an error: the stream shares
    /// an open one, and no other is tried for a jittered pause ([`ON_DEMAND_RETRY_INITIAL`],
    /// doubling up to [`ON_DEMAND_RETRY_MAX`] while they keep failing). A broker that cannot be
    /// reached at all ([`ClientError::Unreachable`]) is not tried again over HTTP/2.
    pub async fn connect(cfg: DialerConfig) -> Result<Self, ClientError> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_slots(cfg, 1, cpus.clamp(1, MAX_ON_DEMAND_CONNECTIONS)).await
    }

    /// Opens `connections` HTTP/2 connections (1 to [`MAX_CONNECTIONS`]) to the broker; each
    /// new stream goes on the one with the fewest open streams. One connection is one TLS
    /// session and one HTTP/2 connection task on each end, so its streams' encryption and
    /// framing run on one core at a time: several busy streams go faster over several
    /// connections (`tetherctl proxy connect` opens one per worker thread).
    pub async fn connect_pool(cfg: DialerConfig, connections: usize) -> Result<Self, ClientError> {
        let n = connections.clamp(1, MAX_CONNECTIONS);
        Self::with_slots(cfg, n, n).await
    }

    /// `open` connections now, `slots` in all (the rest opened on demand, see [`Self::pick`]).
    async fn with_slots(cfg: DialerConfig, open: usize, slots: usize) -> Result<Self, ClientError> {
        let opened =
            futures::future::try_join_all((0..open).map(|_| Self::connect_one(&cfg))).await?;
        let mut opened = opened.into_iter();
        let slots: Arc<[Slot]> = (0..slots.max(open))
            .map(|_| Slot::new(opened.next()))
            .collect();
        let token = match &cfg.token {
            Some(t) => Some(
                format!("Bearer {}", t.0)
                    .parse()
                    .map_err(|_| ClientError::BadToken)?,
            ),
            None => None,
        };
        Ok(Self {
            slots,
            cfg: Arc::new(cfg),
            retry: Arc::new(std::sync::Mutex::new(OnDemandRetry::new())),
            next: Arc::new(AtomicUsize::new(0)),
            token,
            raw: Arc::new(AtomicBool::new(true)),
        })
    }

    /// Number of connections to the broker opened so far.
    pub fn connections(&self) -> usize {
        self.slots.iter().filter(|s| s.conn.initialized()).count()
    }

    /// The slot for a new stream, with the stream counted in its load: the least loaded of the
    /// open connections and of the slots being opened (ties: an open connection, then round
    /// robin); when that one carries a stream, a free slot, whose connection is then opened
    /// (unless one failed to open within [`OnDemandRetry`]'s pause). A dial that picks a slot
    /// being opened waits for it; if it fails to open, the dial shares the least busy open one.
    async fn pick(&self) -> (&Conn, ConnLoad) {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = self.slots.len();
        let in_turn = || (0..n).map(|i| (start + i) % n);
        let open_or_opening = |i: &usize| {
            let s = &self.slots[*i];
            s.conn.initialized() || s.load() > 0
        };
        let (best, best_load) = in_turn()
            .filter(open_or_opening)
            .map(|i| (i, self.slots[i].load()))
            .min_by_key(|&(i, load)| (load, !self.slots[i].conn.initialized()))
            .expect("the first connection is opened by connect");
        let mut i = best;
        if best_load > 0
            && let Some(free) = in_turn().find(|i| !open_or_opening(i))
            && self.retry.lock().expect("retry state").allowed()
        {
            i = free;
        }
        let slot = &self.slots[i];
        slot.load.fetch_add(1, Ordering::Relaxed);
        let load = ConnLoad(Arc::clone(&slot.load), i);
        if let Some(c) = slot.conn.get() {
            return (c, load);
        }
        let opened = slot
            .conn
            .get_or_try_init(|| async {
                if !self.retry.lock().expect("retry state").allowed() {
                    // This dial waited for an opening that failed; another failure would not
                    // tell anything new.
                    return Err(ClientError::Connect(
                        "an earlier connection on demand failed to open".into(),
                    ));
                }
                let r = Self::connect_one(&self.cfg).await;
                let mut retry = self.retry.lock().expect("retry state");
                match &r {
                    Ok(_) => retry.opened(),
                    Err(e) => {
                        let pause = retry.failed();
                        tracing::debug!(error = %e, ?pause, "no connection on demand; sharing one");
                    }
                }
                r
            })
            .await;
        if let Ok(c) = opened {
            return (c, load);
        }
        drop(load);
        let (i, c) = in_turn()
            .filter_map(|i| Some((i, self.slots[i].conn.get()?)))
            .min_by_key(|&(i, _)| self.slots[i].load())
            .expect("the first connection is opened by connect");
        let slot = &self.slots[i];
        slot.load.fetch_add(1, Ordering::Relaxed);
        (c, ConnLoad(Arc::clone(&slot.load), i))
    }

    async fn connect_one(cfg: &DialerConfig) -> Result<Conn, ClientError> {
        let endpoint_err = |reason: String| ClientError::Endpoint {
            endpoint: cfg.endpoint.clone(),
            reason,
        };
        let endpoint =
            Endpoint::from_shared(cfg.endpoint.clone()).map_err(|e| endpoint_err(e.to_string()))?;
        let endpoint = match endpoint.uri().scheme_str() {
            Some("https") => {
                let mut tls = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&cfg.ca_pem))
                    .domain_name(cfg.server_name.clone());
                if let Some(c) = &cfg.client_cert {
                    tls = tls.identity(Identity::from_pem(&c.cert_pem, &c.key_pem));
                }
                endpoint
                    .tls_config(tls)
                    .map_err(|e| endpoint_err(e.to_string()))?
            }
            Some("http") if cfg.client_cert.is_some() => {
                return Err(endpoint_err(
                    "a client certificate needs TLS: use the broker's https:// client TLS \
                     listener, or a bearer token with http://"
                        .into(),
                ));
            }
            Some("http") => endpoint,
            other => {
                return Err(endpoint_err(format!(
                    "scheme {:?}: expected https://host:port (client TLS listener) or \
                     http://host:port (plain client listener)",
                    other.unwrap_or("")
                )));
            }
        };
        let opener = Arc::new(opener::Opener::new(cfg, endpoint.uri())?);
        let credential = cfg.token.as_ref().map(|t| format!("Bearer {}", t.0));
        let (mux, raw) = match mux::MuxConn::open(Arc::clone(&opener), credential).await {
            Ok(m) => (Some(m), raw::RawConn::lazy(opener)),
            // Not reached at all, or a certificate not accepted: HTTP/2 would fail the same
            // way (and would wait, or handshake, once more).
            Err(e @ (ClientError::Unreachable(_) | ClientError::Certificate(_))) => {
                return Err(e);
            }
            Err(e) => {
                // An older broker (or `tunnel.protocol: h2`): HTTP/2, whose connect error (if
                // any) names what is wrong.
                tracing::debug!(error = %e, "tether-dial/1 not available; using HTTP/2");
                (None, raw::RawConn::open(opener).await?)
            }
        };
        let channel = endpoint
            .connect_timeout(cfg.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .initial_connection_window_size((1 << 31) - 1)
            // The broker's frames towards us (downloads: kube watches, large GETs) as large as
            // ours towards it; HTTP/2's default would cut them into 16 KiB frames.
            .max_frame_size(MAX_FRAME_BYTES as u32)
            .connect_lazy();
        Ok(Conn {
            mux,
            raw,
            client: pb::dialer_client::DialerClient::new(channel)
                .max_decoding_message_size(4 * MAX_FRAME_BYTES),
        })
    }

    /// Opens a connection to `host:port` inside `cluster` (empty host: the API server), with
    /// the unframed Dial when the broker serves it, else the framed gRPC `Dial`.
    pub async fn dial(
        &self,
        cluster: &str,
        host: &str,
        port: u16,
    ) -> Result<DialStream, ClientError> {
        if let Some(s) = self.dial_mux(cluster, host, port).await? {
            return Ok(s);
        }
        if self.raw.load(Ordering::Relaxed) {
            match self.dial_raw(cluster, host, port).await? {
                Some(s) => return Ok(s),
                None => self.raw.store(false, Ordering::Relaxed),
            }
        }
        self.dial_framed(cluster, host, port).await
    }

    /// A dial over `tether-dial/1`; `None` when the connection picked does not speak it.
    async fn dial_mux(
        &self,
        cluster: &str,
        host: &str,
        port: u16,
    ) -> Result<Option<DialStream>, ClientError> {
        let (conn, load) = self.pick().await;
        let Some(m) = &conn.mux else {
            return Ok(None);
        };
        let target =
            tether_tunnel::Target::from_parts(cluster, host, u32::from(port)).map_err(|e| {
                ClientError::Dial {
                    code: pb::DialErrorCode::BadRequest,
                    message: e.to_string(),
                }
            })?;
        let (tx, rx, answer) = m.dial(cluster, target.wire_dest()).await?;
        Ok(Some(DialStream::new(
            Outbound::Mux(mux::MuxOut::new(tx)),
            Inbound::Mux(rx),
            answer.stream_id,
            u64::from(answer.tunnel_rtt_micros),
            load,
        )))
    }

    /// The unframed Dial; `None` when the broker does not serve it.
    async fn dial_raw(
        &self,
        cluster: &str,
        host: &str,
        port: u16,
    ) -> Result<Option<DialStream>, ClientError> {
        let (conn, load) = self.pick().await;
        let port = port.to_string();
        let trace = trace_context();
        let (resp, tx) = conn
            .raw
            .request(|req| {
                let req = req
                    .header("content-type", "application/octet-stream")
                    .header("tether-cluster", cluster)
                    .header("tether-host", host)
                    .header("tether-port", port.as_str());
                let req = trace
                    .iter()
                    .fold(req, |req, (k, v)| req.header(k.as_str(), v.as_str()));
                match &self.token {
                    Some(t) => req.header("authorization", t.as_encoded_bytes()),
                    None => req,
                }
            })
            .await?;
        let (head, mut body) = resp.into_parts();
        if head.headers.contains_key("grpc-status") {
            return Ok(None); // an older broker: unknown gRPC method
        }
        let text = |name: &str| {
            head.headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        if head.status != http::StatusCode::OK {
            let kind = text("tether-error");
            if kind.is_empty() {
                return Err(ClientError::BadAnswer(head.status.as_u16()));
            }
            let message = read_refusal(&mut body).await;
            if kind == "unauthenticated" {
                return Err(ClientError::Status(tonic::Status::unauthenticated(message)));
            }
            return Err(ClientError::Dial {
                code: code_of_label(&kind),
                message,
            });
        }
        let stream_id = text("tether-stream-id").parse().unwrap_or(0);
        let rtt: u64 = text("tether-tunnel-rtt-micros").parse().unwrap_or(0);
        Ok(Some(DialStream::new(
            Outbound::Raw { tx, shut: false },
            Inbound::Raw(body),
            stream_id,
            rtt,
            load,
        )))
    }

    /// Opens a connection with the framed gRPC `Dial` RPC (one protobuf `DialFrame` per chunk),
    /// as every broker serves it.
    pub async fn dial_framed(
        &self,
        cluster: &str,
        host: &str,
        port: u16,
    ) -> Result<DialStream, ClientError> {
        let (tx, rx) = mpsc::channel(SEND_QUEUE_FRAMES);
        let (abort_tx, abort_rx) = tokio::sync::oneshot::channel();
        let mut req = tonic::Request::new(RequestFrames {
            first: Some(pb::DialFrame {
                kind: Some(pb::dial_frame::Kind::Dial(pb::DialRequest {
                    cluster: cluster.to_owned(),
                    host: host.to_owned(),
                    port: port.into(),
                    timeout_ms: 0,
                })),
            }),
            frames: tokio_stream::wrappers::ReceiverStream::new(rx),
            abort: Some(abort_rx),
            aborted: false,
        });
        if let Some(t) = &self.token {
            req.metadata_mut().insert("authorization", t.clone());
        }
        for (k, v) in trace_context() {
            if let (Ok(k), Ok(v)) = (
                tonic::metadata::MetadataKey::from_bytes(k.as_bytes()),
                v.parse(),
            ) {
                req.metadata_mut().insert(k, v);
            }
        }
        let (conn, load) = self.pick().await;
        let answer = async {
            let mut inbound = conn.client.clone().dial(req).await?.into_inner();
            let first = inbound.message().await?.ok_or(ClientError::NoAnswer)?;
            Ok::<_, ClientError>((inbound, first))
        };
        let (inbound, first) = tokio::time::timeout(DIAL_ANSWER_TIMEOUT, answer)
            .await
            .map_err(|_| ClientError::NoAnswerWithin(DIAL_ANSWER_TIMEOUT))??;
        let Some(pb::dial_frame::Kind::Result(result)) = first.kind else {
            return Err(ClientError::NoAnswer);
        };
        if !result.ok {
            return Err(ClientError::Dial {
                code: result.code(),
                message: result.message,
            });
        }
        let inbound = inbound
            .filter_map(|m| async move {
                match m {
                    Ok(pb::DialFrame {
                        kind: Some(pb::dial_frame::Kind::Data(b)),
                    }) => Some(Ok(b)),
                    Ok(_) => None,
                    Err(status) => Some(Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("tunnel stream aborted: {}", status.message()),
                    ))),
                }
            })
            .boxed();
        Ok(DialStream::new(
            Outbound::Framed {
                tx: PollSender::new(tx),
                abort: Some(abort_tx),
            },
            Inbound::Framed(inbound),
            result.stream_id,
            result.tunnel_rtt_micros,
            load,
        ))
    }

    /// Opens a connection to `cluster`'s API server.
    pub async fn dial_api_server(&self, cluster: &str) -> Result<DialStream, ClientError> {
        self.dial(cluster, "", 0).await
    }

    /// A `kube::Client` for `cluster`, with TLS, CA and credentials from `config` (the
    /// cluster's kubeconfig), whose connections all go through the tunnel.
    pub fn kube_client(
        &self,
        cluster: &str,
        config: kube::Config,
    ) -> Result<kube::Client, ClientError> {
        use kube::client::ConfigExt as _;
        let kube_err = |e: kube::Error| ClientError::Kube(e.to_string());
        let connector = TunnelConnector {
            dialer: self.clone(),
            cluster: cluster.to_owned(),
        };
        let https = config
            .rustls_https_connector_with_connector(connector)
            .map_err(kube_err)?;
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build::<_, kube::client::Body>(https);
        let service = tower::ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(config.auth_layer().map_err(kube_err)?)
            .map_err(
                |e: hyper_util::client::legacy::Error| -> Box<dyn std::error::Error + Send + Sync> {
                    Box::new(e)
                },
            )
            .service(http);
        Ok(kube::Client::new(service, config.default_namespace))
    }
}

/// A hyper connector that opens every connection as a tunnel stream to one cluster's API server.
#[derive(Clone)]
struct TunnelConnector {
    dialer: Dialer,
    cluster: String,
}

impl tower::Service<http::Uri> for TunnelConnector {
    type Response = hyper_util::rt::TokioIo<DialStream>;
    type Error = ClientError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ClientError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ClientError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let dialer = self.dialer.clone();
        let cluster = self.cluster.clone();
        Box::pin(async move {
            Ok(hyper_util::rt::TokioIo::new(
                dialer.dial_api_server(&cluster).await?,
            ))
        })
    }
}

/// The request side of a framed dial: the dial frame, then queued data frames, unless the
/// stream is dropped without shutdown — then one `abort` frame, and the request stays open so
/// that nothing reads as a half-close.
struct RequestFrames {
    first: Option<pb::DialFrame>,
    frames: tokio_stream::wrappers::ReceiverStream<Bytes>,
    /// Fires on drop without shutdown; dropped unfired by `shutdown()`.
    abort: Option<tokio::sync::oneshot::Receiver<()>>,
    aborted: bool,
}

impl Stream for RequestFrames {
    type Item = pb::DialFrame;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<pb::DialFrame>> {
        if let Some(f) = self.first.take() {
            return Poll::Ready(Some(f));
        }
        if self.aborted {
            return Poll::Pending; // the broker resets the call
        }
        if let Some(rx) = self.abort.as_mut() {
            match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(())) => {
                    self.aborted = true;
                    self.abort = None;
                    return Poll::Ready(Some(pb::DialFrame {
                        kind: Some(pb::dial_frame::Kind::Abort(pb::Abort {
                            reason: "client dropped the stream".into(),
                        })),
                    }));
                }
                Poll::Ready(Err(_)) => self.abort = None, // shut down gracefully
                Poll::Pending => {}
            }
        }
        Pin::new(&mut self.frames).poll_next(cx).map(|b| {
            b.map(|b| pb::DialFrame {
                kind: Some(pb::dial_frame::Kind::Data(b)),
            })
        })
    }
}

/// Reads a refusal's text (bounded in size and time).
async fn read_refusal(body: &mut h2::RecvStream) -> String {
    let mut out = Vec::new();
    let read = async {
        while out.len() < MAX_REFUSAL_BYTES {
            match std::future::poll_fn(|cx| raw::poll_read_raw(body, cx)).await {
                Some(Ok(b)) => out.extend_from_slice(&b),
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(REFUSAL_READ_TIMEOUT, read).await;
    out.truncate(MAX_REFUSAL_BYTES);
    String::from_utf8_lossy(&out).trim_end().to_owned()
}

/// The broker's `tether-error` label as a dial error code.
fn code_of_label(label: &str) -> pb::DialErrorCode {
    use pb::DialErrorCode as C;
    match label {
        "bad_request" => C::BadRequest,
        "forbidden" | "unauthenticated" => C::Forbidden,
        "no_tunnel" | "tunnel_lost" => C::NoTunnel,
        "agent_policy" => C::AgentPolicy,
        "refused" => C::Refused,
        "timeout" => C::Timeout,
        "name_not_found" => C::NameNotFound,
        "overloaded" => C::Overloaded,
        "unknown_cluster" => C::UnknownCluster,
        _ => C::Internal,
    }
}

/// [`MAX_FRAME_BYTES`] buffers lent out as `Bytes` and recycled: a buffer comes back once the
/// last `Bytes` cut from it is dropped (h2 wrote it), so a busy stream reuses a few buffers
/// instead of allocating (and, with glibc's allocator, page-faulting) 256 KiB per chunk. At
/// most [`POOLED_CHUNKS`] are kept; the rest are freed.
#[derive(Clone)]
pub struct ChunkPool(tether_bufpool::BufPool);

impl Default for ChunkPool {
    fn default() -> Self {
        Self(tether_bufpool::BufPool::new(POOLED_CHUNKS))
    }
}

impl ChunkPool {
    /// An empty buffer with [`MAX_FRAME_BYTES`] of capacity, recycled when one is free.
    pub fn take(&self) -> Vec<u8> {
        self.0.take(MAX_FRAME_BYTES)
    }

    /// A copy of `buf` (at most [`MAX_FRAME_BYTES`]) as a chunk to send: into a right-sized
    /// buffer below [`COPY_BELOW`], else into a pooled one.
    pub fn copy(&self, buf: &[u8]) -> Bytes {
        if buf.len() < COPY_BELOW {
            return Bytes::copy_from_slice(buf);
        }
        let mut b = self.take();
        b.extend_from_slice(buf);
        self.lend(b)
    }

    /// `buf`'s bytes as `Bytes` without a copy; the buffer returns to this pool when the last
    /// `Bytes` cut from it is dropped.
    pub fn lend(&self, buf: Vec<u8>) -> Bytes {
        self.0.lend(buf)
    }

    /// Buffers waiting for reuse.
    pub fn free(&self) -> usize {
        self.0.free()
    }
}

/// The framed Dial's chunks from the broker.
type FramedInbound = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

/// Where a stream's bytes from the target come from.
enum Inbound {
    /// A `tether-dial/1` stream.
    Mux(tether_tunnel::mux::RecvHalf),
    /// The response body of an unframed dial, read from h2 directly.
    Raw(h2::RecvStream),
    Framed(FramedInbound),
}

impl Inbound {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        match self {
            Inbound::Mux(rx) => mux::poll_read_mux(rx, cx),
            Inbound::Raw(rx) => raw::poll_read_raw(rx, cx),
            Inbound::Framed(s) => s.as_mut().poll_next(cx),
        }
    }
}

/// Where a stream's bytes towards the target go.
enum Outbound {
    /// A `tether-dial/1` stream: FIN on `shutdown()`; a drop without shutdown resets it (the
    /// broker then resets the target's connection).
    Mux(mux::MuxOut),
    /// The request body of an unframed dial: h2's send half, written directly. END_STREAM on
    /// `shutdown()`; a drop without shutdown resets the HTTP/2 stream (the broker then resets
    /// the target's connection).
    Raw {
        tx: h2::SendStream<Bytes>,
        /// END_STREAM sent.
        shut: bool,
    },
    /// The framed dial's queue to its request stream ([`RequestFrames`]).
    Framed {
        tx: PollSender<Bytes>,
        /// Fired on drop without shutdown; dropped unfired by `shutdown()`.
        abort: Option<tokio::sync::oneshot::Sender<()>>,
    },
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "stream closed")
}

/// One tunnelled TCP connection.
pub struct DialStream {
    out: Outbound,
    /// The response side; taken only by `Drop`.
    rx: Option<Inbound>,
    pending: Bytes,
    eof: bool,
    stream_id: u64,
    tunnel_rtt: Option<Duration>,
    /// Counts this stream on its connection until dropped.
    load: ConnLoad,
    /// Buffers for `poll_write`'s copies.
    pool: ChunkPool,
    /// Whether a drop after `shutdown()` reads on until the target's EOF (cleared by
    /// [`DialStream::abort`]).
    linger: bool,
}

impl DialStream {
    /// A stream the broker accepted: its two halves, its id, the tunnel's round trip in µs
    /// (0: unknown), and its share of its connection's load.
    fn new(out: Outbound, rx: Inbound, stream_id: u64, rtt_micros: u64, load: ConnLoad) -> Self {
        Self {
            out,
            rx: Some(rx),
            pending: Bytes::new(),
            eof: false,
            stream_id,
            tunnel_rtt: (rtt_micros > 0).then(|| Duration::from_micros(rtt_micros)),
            load,
            pool: ChunkPool::default(),
            linger: true,
        }
    }

    /// Whether this stream uses the unframed Dial (`DialRaw`) rather than the framed gRPC one.
    pub fn is_unframed(&self) -> bool {
        !matches!(self.out, Outbound::Framed { .. })
    }

    /// How this stream reaches the broker: `tether-dial/1`, `DialRaw` (unframed, HTTP/2) or
    /// `Dial` (framed gRPC).
    pub fn protocol(&self) -> &'static str {
        match self.out {
            Outbound::Mux(_) => "tether-dial/1",
            Outbound::Raw { .. } => "DialRaw",
            Outbound::Framed { .. } => "Dial",
        }
    }

    /// The broker's last measured round trip of the tunnel carrying this stream.
    pub fn tunnel_rtt(&self) -> Option<Duration> {
        self.tunnel_rtt
    }

    /// The broker's id for this stream (appears in its logs and traces).
    pub fn stream_id(&self) -> u64 {
        self.stream_id
    }

    /// Index of the [`Dialer`]'s HTTP/2 connection this stream is on (0 without a pool).
    pub fn connection(&self) -> usize {
        self.load.1
    }

    /// Aborts the stream now, even after `shutdown()`: the broker resets the target's
    /// connection, and nothing more is read. Dropping a stream that was shut down instead reads
    /// on until the target's EOF (for at most [`LINGER_AFTER_SHUTDOWN`] and
    /// [`LINGER_MAX_BYTES`]), so that what was written before `shutdown()` still arrives; a
    /// caller whose own peer is gone (a forward whose local client reset) has nothing to wait
    /// for and must not keep a target that streams, a log follower or a watch, sending into the
    /// tunnel meanwhile.
    pub fn abort(mut self) {
        self.linger = false;
    }

    /// Ready once [`DialStream::send`] may queue a chunk (the owned-buffer form of
    /// `poll_write`, for callers that read into their own `Bytes`: no copy here).
    pub fn poll_send_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.out {
            Outbound::Mux(m) => m.poll_ready(cx),
            Outbound::Raw { tx, .. } => raw::poll_send_ready_raw(tx, cx, MAX_FRAME_BYTES),
            Outbound::Framed { tx, .. } => tx.poll_reserve(cx).map_err(|_| closed()),
        }
    }

    /// Queues `data` (at most [`MAX_FRAME_BYTES`]) towards the target as it is, without
    /// copying; call after [`DialStream::poll_send_ready`] returned `Ready(Ok(()))`.
    pub fn send(&mut self, data: Bytes) -> io::Result<()> {
        if data.len() > MAX_FRAME_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("chunk of {} bytes exceeds {MAX_FRAME_BYTES}", data.len()),
            ));
        }
        if data.is_empty() {
            return Ok(());
        }
        match &mut self.out {
            Outbound::Mux(m) => m.send(data),
            // Beyond the capacity granted, h2 queues the rest of the chunk: at most one chunk
            // over [`raw::SEND_BUFFER_BYTES`].
            Outbound::Raw { tx, .. } => tx.send_data(data, false).map_err(raw::write_error),
            Outbound::Framed { tx, .. } => tx.send_item(data).map_err(|_| closed()),
        }
    }

    /// The next chunk from the target as the broker sent it (the owned-buffer form of
    /// `poll_read`: no copy); `None` at the target's EOF. Bytes already partly read through
    /// `AsyncRead` come first.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if !self.pending.is_empty() {
            return Poll::Ready(Some(Ok(std::mem::take(&mut self.pending))));
        }
        if self.eof {
            return Poll::Ready(None);
        }
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Ready(None);
        };
        match ready!(rx.poll_next(cx)) {
            Some(r) => Poll::Ready(Some(r)),
            None => {
                self.eof = true;
                Poll::Ready(None)
            }
        }
    }
}

impl hyper_util::client::legacy::connect::Connection for DialStream {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        hyper_util::client::legacy::connect::Connected::new()
    }
}

impl AsyncRead for DialStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                buf.put_slice(&self.pending[..n]);
                self.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            if self.eof {
                return Poll::Ready(Ok(()));
            }
            let Some(rx) = self.rx.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            match ready!(rx.poll_next(cx)) {
                Some(Ok(b)) => self.pending = b,
                Some(Err(e)) => return Poll::Ready(Err(e)),
                None => self.eof = true,
            }
        }
    }
}

impl AsyncWrite for DialStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let this = &mut *self;
        let tx = match &mut this.out {
            Outbound::Mux(m) => return m.poll_write(&this.pool, cx, buf),
            Outbound::Raw { tx, .. } => return raw::poll_write_raw(tx, &this.pool, cx, buf),
            Outbound::Framed { tx, .. } => tx,
        };
        ready!(tx.poll_reserve(cx)).map_err(|_| closed())?;
        let n = buf.len().min(MAX_FRAME_BYTES);
        tx.send_item(this.pool.copy(&buf[..n]))
            .map_err(|_| closed())?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.out {
            Outbound::Mux(m) => return m.poll_shutdown(cx),
            Outbound::Raw { tx, shut } => {
                if !*shut {
                    *shut = true;
                    // An error means the stream is already reset: the next read reports it.
                    let _ = tx.send_data(Bytes::new(), true);
                }
            }
            Outbound::Framed { tx, abort } => {
                *abort = None; // a graceful end, not an abort
                tx.close();
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for DialStream {
    fn drop(&mut self) {
        // Not shut down: an abort, even after the target's EOF. The target having finished its
        // side says nothing about ours: ending the request stream instead would read as a clean
        // EOF at the target, after however many bytes had been written (a silent truncation).
        let shut = match &mut self.out {
            Outbound::Mux(m) => {
                if !m.shut || !self.linger {
                    // Dropping both halves resets the stream.
                    return;
                }
                true
            }
            Outbound::Raw { tx, shut } => {
                if !*shut || !self.linger {
                    tx.send_reset(h2::Reason::CANCEL);
                    return;
                }
                true
            }
            Outbound::Framed { abort, .. } => match abort.take() {
                Some(abort) => {
                    let _ = abort.send(());
                    return;
                }
                None => true,
            },
        };
        if !shut || self.eof || !self.linger {
            // Dropping the response stream cancels the call (RST_STREAM once the request side
            // has gone out): the broker resets the target's connection.
            return;
        }
        // Shut down gracefully but dropped before the target's EOF: dropping the response
        // stream now would cancel the call and the frames still queued (written before
        // `shutdown()`) would never reach the target. Read on, discarding, until the broker
        // ends the call, for at most `LINGER_AFTER_SHUTDOWN` and `LINGER_MAX_BYTES`; then
        // dropping the response stream cancels the call (an abort).
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        rt.spawn(async move {
            let _ = tokio::time::timeout(LINGER_AFTER_SHUTDOWN, async {
                let mut discarded = 0;
                while let Some(Ok(b)) = std::future::poll_fn(|cx| rx.poll_next(cx)).await {
                    discarded += b.len();
                    if discarded > LINGER_MAX_BYTES {
                        break;
                    }
                }
            })
            .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_pool_lends_frame_sized_buffers_and_keeps_pooled_chunks() {
        let pool = ChunkPool::default();
        let a = pool.take();
        assert!(a.capacity() >= MAX_FRAME_BYTES && a.is_empty());
        let bufs: Vec<Bytes> = (0..POOLED_CHUNKS + 3)
            .map(|_| {
                let mut b = pool.take();
                b.push(1);
                pool.lend(b)
            })
            .collect();
        assert_eq!(pool.free(), 0);
        drop(bufs);
        assert_eq!(pool.free(), POOLED_CHUNKS);
    }

    /// Only a refusal for capacity asks the caller to wait and retry; every label the broker
    /// sends maps to a code, and the others (a refused target, a missing tunnel, a forbidden
    /// cluster, an unreachable broker) offer no delay.
    #[test]
    fn only_a_refusal_for_capacity_carries_retry_after() {
        for kind in tether_tunnel::DialErrorKind::ALL {
            let e = ClientError::Dial {
                code: code_of_label(kind.metric_label()),
                message: String::new(),
            };
            let want =
                (kind == tether_tunnel::DialErrorKind::Overloaded).then(|| Duration::from_secs(1));
            assert_eq!(e.retry_after(), want, "{kind:?}");
        }
        assert_eq!(ClientError::Unreachable("gone".into()).retry_after(), None);
        assert_eq!(ClientError::NoAnswer.retry_after(), None);
    }
}
