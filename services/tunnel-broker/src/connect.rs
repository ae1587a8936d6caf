//! The HTTP CONNECT front end (plain TCP and TLS).
//!
//! `CONNECT <cluster>:443` reaches the cluster's API server; `CONNECT
//! <host>.<cluster>.tether:<port>` any other allowed target. Answers explain failures: 400
//! malformed request, 405 not CONNECT, 407 no/invalid credentials, 403 not allowed, 502 no tunnel
//! / refused / name not found, 503 overloaded (with `Retry-After`), 504 dial timeout — the
//! reason is in the body and in `Tether-Error`.
//!
//! The plain port also serves gRPC without TLS (h2c with prior knowledge): a connection that
//! opens with the HTTP/2 preface instead of a request head goes to the gRPC front end
//! ([`crate::grpc::GrpcFrontEnd`]: the native Dial, its unframed form, konnectivity), with a
//! bearer token in `authorization` metadata. So a client on the same trusted network as plain
//! CONNECT (the broker's host, or a network that already protects its traffic) can use the Rust
//! SDK without paying client-side TLS, exactly as plain CONNECT does not.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tether_tunnel::lingering::{LINGER_TIMEOUT, LingeringClose, close_gracefully};
use tether_tunnel::pump::AbortableWrite;
use tether_tunnel::pump::{AsyncChunkReader, ResettableWriteHalf, TcpChunkReader};
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{DialError, Target};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::Instrument;

use crate::auth::ClientId;
use crate::dial::Broker;

/// Largest CONNECT request head accepted.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Time a client has to send its CONNECT head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Most headers parsed in a CONNECT head.
const MAX_HEADERS: usize = 32;

const FRONTEND: &str = "connect";

/// A parsed CONNECT request head.
#[derive(Debug)]
pub struct Head {
    /// The target named by the request line (an error names what is wrong with it).
    pub target: Result<Target, DialError>,
    /// The `Proxy-Authorization` value, when present and UTF-8.
    pub credentials: Option<String>,
    /// W3C trace-context headers (`traceparent`, `tracestate`) the client sent, name and value:
    /// the stream's span joins the client's trace.
    pub trace: Vec<(String, String)>,
}

/// Parses a request head from the bytes read so far: `Ok(None)` while incomplete, else the
/// head and its length in `buf`. A pure function (the fuzz target `connect_head` calls it).
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, DialError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => Ok(None),
        Ok(httparse::Status::Complete(len)) => {
            let method = req.method.unwrap_or("");
            if method != "CONNECT" {
                return Err(DialError::new(
                    DialErrorKind::BadRequest,
                    format!("method {method} not supported: this is an HTTP CONNECT proxy"),
                ));
            }
            let path = req.path.unwrap_or("");
            let credentials = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("proxy-authorization"))
                .and_then(|h| std::str::from_utf8(h.value).ok())
                .map(str::to_owned);
            let trace = req
                .headers
                .iter()
                .filter(|h| tether_telemetry::propagation::is_trace_header(h.name))
                .filter_map(|h| {
                    Some((
                        h.name.to_owned(),
                        std::str::from_utf8(h.value).ok()?.to_owned(),
                    ))
                })
                .collect();
            let target = Target::parse(path)
                .map_err(|e| DialError::new(DialErrorKind::BadRequest, e.to_string()));
            Ok(Some((
                Head {
                    target,
                    credentials,
                    trace,
                },
                len,
            )))
        }
        Err(e) => Err(DialError::new(
            DialErrorKind::BadRequest,
            describe_malformed(buf, e),
        )),
    }
}

/// The HTTP/2 connection preface (RFC 9113 §3.4): a client speaking HTTP/2 with prior
/// knowledge (h2c) opens with it.
pub const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The preface's request line: enough to name an HTTP/2 client where h2c is not served.
const H2_PREFACE_LINE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// How a client connection opened.
enum Opening {
    /// A CONNECT request head and any bytes the client sent after it.
    Connect(Head, Bytes),
    /// The HTTP/2 preface (only where `h2c` was allowed): every byte read so far.
    H2c(Bytes),
    /// The `tether-dial/1` preface (only where `dial` was allowed): the bytes after it.
    Dial(Bytes),
}

/// Reads a request head; returns it and any bytes the client sent after it. With `h2c`, a
/// connection that opens with the HTTP/2 preface is returned as [`Opening::H2c`] instead.
/// With `dial`, one that opens with `tether-dial/1`'s preface is returned as [`Opening::Dial`].
async fn read_head<S: AsyncRead + Unpin>(
    s: &mut S,
    h2c: bool,
    dial: bool,
) -> Result<Opening, DialError> {
    let mut buf = BytesMut::with_capacity(1024);
    let work = async {
        loop {
            if buf.len() >= MAX_HEAD_BYTES {
                return Err(DialError::new(
                    DialErrorKind::BadRequest,
                    format!("request head exceeds {MAX_HEAD_BYTES} bytes"),
                ));
            }
            let n = s
                .read_buf(&mut buf)
                .await
                .map_err(|e| DialError::new(DialErrorKind::BadRequest, format!("read: {e}")))?;
            if n == 0 {
                return Err(DialError::new(
                    DialErrorKind::BadRequest,
                    "connection closed before the request head ended",
                ));
            }
            if dial {
                let preface = crate::client_mux::DIAL_PREFACE;
                if buf.starts_with(preface) {
                    return Ok(Opening::Dial(buf.split_off(preface.len()).freeze()));
                }
                if preface.starts_with(&buf) {
                    continue; // the preface so far: wait for the rest
                }
            }
            if h2c {
                if buf.starts_with(H2_PREFACE) {
                    return Ok(Opening::H2c(buf.freeze()));
                }
                if H2_PREFACE.starts_with(&buf) {
                    continue; // the preface so far: wait for the rest
                }
            }
            if let Some((head, len)) = parse_head(&buf)? {
                return Ok(Opening::Connect(head, buf.split_off(len).freeze()));
            }
        }
    };
    tokio::time::timeout(HEAD_TIMEOUT, work)
        .await
        .map_err(|_| {
            DialError::new(
                DialErrorKind::BadRequest,
                format!("no complete request head within {HEAD_TIMEOUT:?}"),
            )
        })?
}

/// Names what is wrong with a head httparse rejected (its own messages, such as "invalid
/// token" for a bare `CONNECT`, read like an authentication failure).
fn describe_malformed(buf: &[u8], e: httparse::Error) -> String {
    const USAGE: &str = "send `CONNECT <host>:<port> HTTP/1.1`";
    if buf.first() == Some(&0x16) {
        return "malformed request: this looks like a TLS handshake, but this port speaks \
                plain HTTP CONNECT (use the client TLS port for TLS)"
            .into();
    }
    if buf.starts_with(H2_PREFACE_LINE) {
        return "malformed request: this is an HTTP/2 connection preface; on the client TLS port \
                negotiate ALPN h2 for gRPC (ALPN http/1.1 is HTTP CONNECT)"
            .into();
    }
    let end = buf
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(buf.len());
    let line = String::from_utf8_lossy(&buf[..end.min(200)]);
    let words: Vec<&str> = line.split(' ').filter(|w| !w.is_empty()).collect();
    match (e, words.as_slice()) {
        (httparse::Error::TooManyHeaders, _) => {
            format!("malformed request: more than {MAX_HEADERS} header lines")
        }
        (httparse::Error::HeaderName | httparse::Error::HeaderValue, _) => {
            format!("malformed request: a header line is not `name: value` ({e})")
        }
        (_, []) => format!("malformed request: empty request line; {USAGE}"),
        (_, [m]) => format!(
            "malformed request line {line:?}: the method {m:?} has no target and no HTTP \
             version; {USAGE}"
        ),
        (_, [_, _]) => {
            format!("malformed request line {line:?}: no HTTP version after the target; {USAGE}")
        }
        (_, [_, _, v]) if !v.starts_with("HTTP/1.") => {
            format!("malformed request line {line:?}: unsupported HTTP version {v:?}; {USAGE}")
        }
        _ => format!("malformed request line {line:?} ({e}); {USAGE}"),
    }
}

fn error_response(e: &DialError) -> Vec<u8> {
    let status = e.kind.status();
    let body = format!("{}\n", e.message);
    let mut r = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\ntether-error: {}\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
        e.kind.metric_label(),
    );
    if e.kind == DialErrorKind::Unauthenticated {
        r.push_str("proxy-authenticate: Bearer realm=\"tether\"\r\nproxy-authenticate: Basic realm=\"tether\"\r\n");
    }
    if let Some(secs) = crate::budget::retry_after(e) {
        r.push_str(&format!("retry-after: {secs}\r\n"));
    }
    r.push_str("\r\n");
    let mut out = r.into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// Reads the CONNECT head from `io` and opens its stream; returns it with the stream's span.
/// What the client sent after the head (early data) is not held until the dial result: it
/// leaves with the dial request, and the agent writes it to the target once connected (a
/// refused dial drops it). On failure the error is answered (inside the span), `io` closed
/// gracefully, and `None` returned. Failures before the dial (malformed head, bad target,
/// missing or unknown credentials) are counted here; [`Broker::dial`] counts its own.
///
/// The span is created once the head is read and checked, with every field it will carry: the
/// log layer formats a span's fields when it is created and again for each field recorded
/// later, and this is the open path of every CONNECT stream.
///
/// With `h2c` (the plain port), a connection that opens with the HTTP/2 preface is returned as
/// [`Opened::H2c`] with the bytes read, for the gRPC front end.
async fn open_from_head<S: AsyncRead + AsyncWrite + Unpin>(
    broker: &Broker,
    io: &mut S,
    peer: Option<&crate::auth::PeerCert>,
    stream_id: u64,
    h2c: bool,
    dial: bool,
) -> Opened {
    let (head, early) = match read_head(io, h2c, dial).await {
        Ok(Opening::Connect(head, early)) => (head, early),
        Ok(Opening::H2c(read)) => return Opened::H2c(read),
        Ok(Opening::Dial(read)) => return Opened::Dial(read),
        Err(e) => return refuse(broker, io, span(stream_id, None, None, &[]), &e).await,
    };
    let Head {
        target,
        credentials,
        trace,
    } = head;
    let target = match target {
        Ok(t) => t,
        Err(e) => return refuse(broker, io, span(stream_id, None, None, &trace), &e).await,
    };
    let client = match broker
        .auth
        .identify(credentials.as_deref(), peer, "Proxy-Authorization")
    {
        Ok(c) => c,
        Err(e) => {
            let span = span(stream_id, Some(&target), None, &trace);
            return refuse(broker, io, span, &e).await;
        }
    };
    let span = span(stream_id, Some(&target), Some(&client), &trace);
    let dialled = broker
        .dial(FRONTEND, &client, &target, stream_id, None, early)
        .instrument(span.clone())
        .await;
    match dialled {
        Ok(stream) => Opened::Stream(stream, span),
        // Broker::dial counted its own failure.
        Err(e) => {
            answer_error(io, &e).instrument(span).await;
            Opened::Closed
        }
    }
}

/// What [`open_from_head`] made of a client connection.
enum Opened {
    /// A dialled stream and its span.
    Stream(crate::dial::OpenStream, tracing::Span),
    /// The HTTP/2 preface on the plain port: the bytes read so far.
    H2c(Bytes),
    /// The `tether-dial/1` preface on the plain port: the bytes after it.
    Dial(Bytes),
    /// Refused; the answer was sent and the connection closed.
    Closed,
}

/// Counts a failure before the dial, answers it inside `span` and closes `io`.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(
    broker: &Broker,
    io: &mut S,
    span: tracing::Span,
    e: &DialError,
) -> Opened {
    span.in_scope(|| broker.record_failure(FRONTEND, e));
    answer_error(io, e).instrument(span).await;
    Opened::Closed
}

/// Answers `e` on `io` and closes it gracefully.
async fn answer_error<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S, e: &DialError) {
    let _ = io.write_all(&error_response(e)).await;
    let _ = close_gracefully(io, LINGER_TIMEOUT).await;
}

/// The span of one CONNECT stream; `cluster`, `target` and `client` are left out when the
/// request failed before they were known. With `trace` (the request's trace-context headers)
/// it is a child of the client's span.
fn span(
    stream_id: u64,
    target: Option<&Target>,
    client: Option<&ClientId>,
    trace: &[(String, String)],
) -> tracing::Span {
    let span = tracing::info_span!(
        "connect_stream",
        stream = stream_id,
        cluster = target.map(|t| t.cluster.as_str()),
        target = target.map(tracing::field::display),
        client = client.map(|c| c.name.as_str())
    );
    tether_telemetry::propagation::set_parent(&span, trace.iter().map(|(k, v)| (k, v)));
    span
}

/// Serves one plain-TCP client connection: HTTP CONNECT, or gRPC on `grpc` (h2c) when it
/// opens with the HTTP/2 preface.
pub async fn serve_plain(
    broker: Arc<Broker>,
    grpc: &crate::grpc::GrpcFrontEnd,
    mut tcp: TcpStream,
) {
    let _ = tcp.set_nodelay(true);
    let stream_id = broker.next_stream_id();
    let dial = broker.settings.protocol == tether_tunnel::settings::TunnelProtocol::Mux;
    let opened = open_from_head(&broker, &mut tcp, None, stream_id, true, dial).await;
    let protocol = match opened {
        Opened::H2c(_) => "h2",
        Opened::Dial(_) => crate::client_mux::PROTOCOL_LABEL,
        _ => "http1",
    };
    broker
        .metrics
        .client_connections
        .with_label_values(&["plain", protocol])
        .inc();
    let (stream, span) = match opened {
        Opened::Stream(stream, span) => (stream, span),
        // Connections that end as a whole close lingering, as on the TLS port (`ClientTls`).
        Opened::H2c(read) => {
            let io = LingeringClose::new(Rewound::new(read, tcp), LINGER_TIMEOUT);
            grpc.serve_connection(io, None).await;
            return;
        }
        Opened::Dial(read) => {
            let io = LingeringClose::new(Rewound::new(read, tcp), LINGER_TIMEOUT);
            crate::client_mux::serve(broker, io, None).await;
            return;
        }
        Opened::Closed => return,
    };
    async move {
        if tcp.write_all(ESTABLISHED).await.is_err() {
            broker.finish(&stream.ticket, &Ok(Default::default()));
            return;
        }
        let (rd, wr) = tcp.into_split();
        let rd = TcpChunkReader::new(rd, broker.settings.read_chunk_bytes);
        // If the broker dies mid-stream the client must see a reset, not a clean EOF.
        let wr = crate::linger::CrashReset::arm(ResettableWriteHalf::new(wr));
        let _ = broker.splice_paced(stream, rd, wr).await;
    }
    .instrument(span)
    .await
}

/// A TCP connection whose first bytes were already read (the HTTP/2 preface sniffed on the
/// plain port): reads return those bytes first, then the socket's.
struct Rewound {
    read: Bytes,
    tcp: TcpStream,
}

impl Rewound {
    fn new(read: Bytes, tcp: TcpStream) -> Self {
        Self { read, tcp }
    }
}

impl AsyncRead for Rewound {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.read.is_empty() {
            return Pin::new(&mut this.tcp).poll_read(cx, buf);
        }
        let n = this.read.len().min(buf.remaining());
        buf.put_slice(&this.read.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Rewound {
    tether_tunnel::forward_writes!(tcp);
}

/// Serves one client connection that arrived over TLS (ALPN http/1.1).
pub async fn serve_tls<S: TcpBacked + AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    broker: Arc<Broker>,
    mut io: S,
    peer: Option<crate::auth::PeerCert>,
) {
    let stream_id = broker.next_stream_id();
    let Opened::Stream(stream, span) =
        open_from_head(&broker, &mut io, peer.as_ref(), stream_id, false, false).await
    else {
        return;
    };
    async move {
        if io.write_all(ESTABLISHED).await.is_err() || io.flush().await.is_err() {
            broker.finish(&stream.ticket, &Ok(Default::default()));
            return;
        }
        let aborted = Arc::new(AtomicBool::new(false));
        let (rd, wr) = tokio::io::split(ResetOnDrop {
            io,
            aborted: Arc::clone(&aborted),
        });
        let rd = AsyncChunkReader::new(rd, broker.settings.read_chunk_bytes);
        let _ = broker
            .splice_paced(stream, rd, AbortFlagWriteHalf { wr, aborted })
            .await;
    }
    .instrument(span)
    .await
}

/// A stream carried by a TCP socket (a TLS stream over TCP), so an abort can reset it.
pub trait TcpBacked {
    fn tcp(&self) -> &TcpStream;
}

impl TcpBacked for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }
}

impl TcpBacked for crate::ClientTls {
    fn tcp(&self) -> &TcpStream {
        self.get_ref().0.get_ref()
    }
}

/// Owns a client stream split for [`splice`]; when the stream was aborted, its TCP socket is
/// closed with RST (zero linger) instead of a FIN, so a TLS client sees a reset rather than a
/// truncation (and a plain one never an EOF). Dropping a TLS stream sends no close_notify.
struct ResetOnDrop<S: TcpBacked> {
    io: S,
    aborted: Arc<AtomicBool>,
}

impl<S: TcpBacked> Drop for ResetOnDrop<S> {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Relaxed) {
            let _ = self.io.tcp().set_zero_linger();
        }
    }
}

impl<S: TcpBacked + AsyncRead + Unpin> AsyncRead for ResetOnDrop<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<S: TcpBacked + AsyncWrite + Unpin> AsyncWrite for ResetOnDrop<S> {
    tether_tunnel::forward_writes!(io);
}

/// The write half of a [`ResetOnDrop`] stream: an abort marks it for reset.
struct AbortFlagWriteHalf<W> {
    wr: W,
    aborted: Arc<AtomicBool>,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for AbortFlagWriteHalf<W> {
    tether_tunnel::forward_writes!(wr);
}

impl<W: AsyncWrite + Unpin + Send> AbortableWrite for AbortFlagWriteHalf<W> {
    fn abort(&mut self) {
        self.aborted.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Measured 2,936 B (rustc 1.95, dev profile).
    const PLAIN_FUTURE_BYTES: usize = 3_200;
    /// Measured 6,232 B (the TLS session, inline, is most of it).
    const TLS_FUTURE_BYTES: usize = 6_656;

    /// The size of the future `f` returns, without calling it (so no socket or TLS session is
    /// needed to measure a connection's future).
    fn future_size<A, F: Future>(_: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every client connection's task holds its future for the connection's life, and most are
    /// idle CONNECT streams: the broker's memory per idle stream (`tether-bench --only idle`,
    /// 5.2–5.5 KiB) is mostly this future. A branch that grows it (a hyper connection held
    /// inline once grew every plain-port connection's by ~1.9 KiB: 7.1 KiB per idle stream)
    /// fails here rather than only in a benchmark. The bounds are the sizes measured in the dev
    /// profile CI builds (`cargo nextest`), plus a margin for compiler changes.
    #[test]
    fn a_client_connections_future_stays_small() {
        let broker = Arc::new(crate::dial::test_broker());
        let grpc = crate::grpc::GrpcFrontEnd::new(Arc::clone(&broker));
        let plain = future_size(|tcp: TcpStream| serve_plain(Arc::clone(&broker), &grpc, tcp));
        let tls = future_size(|io: crate::ClientTls| serve_tls(Arc::clone(&broker), io, None));
        eprintln!("plain-port connection future {plain} B, TLS CONNECT {tls} B");
        assert!(
            plain <= PLAIN_FUTURE_BYTES,
            "plain-port connection future grew: {plain} B"
        );
        assert!(
            tls <= TLS_FUTURE_BYTES,
            "TLS CONNECT connection future grew: {tls} B"
        );
    }

    /// A refusal for capacity tells the client when to retry (client-go retries a 5xx only
    /// with `Retry-After`); other failures do not invite a retry.
    #[test]
    fn overloaded_answers_carry_retry_after() {
        let text = |kind| {
            String::from_utf8(error_response(&DialError::new(kind, "why"))).expect("utf-8 answer")
        };
        let overloaded = text(DialErrorKind::Overloaded);
        assert!(
            overloaded.starts_with("HTTP/1.1 503 ")
                && overloaded.contains("\r\nretry-after: 1\r\n")
                && overloaded.ends_with("\r\n\r\nwhy\n"),
            "{overloaded:?}"
        );
        for kind in [
            DialErrorKind::NoTunnel,
            DialErrorKind::Forbidden,
            DialErrorKind::Timeout,
        ] {
            let t = text(kind);
            assert!(!t.contains("retry-after"), "{kind:?}: {t:?}");
        }
    }

    async fn head_error(head: &[u8]) -> String {
        let mut s = head;
        match read_head(&mut s, false, false).await {
            Err(e) => e.message,
            Ok(_) => panic!("{:?} parsed", String::from_utf8_lossy(head)),
        }
    }

    #[tokio::test]
    async fn malformed_heads_name_the_problem() {
        let bare = head_error(b"CONNECT\r\n\r\n").await;
        assert!(bare.contains("no target and no HTTP version"), "{bare}");
        assert!(!bare.contains("token"), "{bare}");
        let no_version = head_error(b"CONNECT c1:443\r\n\r\n").await;
        assert!(no_version.contains("no HTTP version"), "{no_version}");
        let version = head_error(b"CONNECT c1:443 HTTP/2.0\r\n\r\n").await;
        assert!(
            version.contains("unsupported HTTP version \"HTTP/2.0\""),
            "{version}"
        );
        let header = head_error(b"CONNECT c1:443 HTTP/1.1\r\nbad header\r\n\r\n").await;
        assert!(header.contains("name: value"), "{header}");
        let tls = head_error(&[0x16, 3, 1, 0, 5, 1, 2, 3, 4, 5]).await;
        assert!(tls.contains("TLS handshake"), "{tls}");
        let method = head_error(b"GET / HTTP/1.1\r\n\r\n").await;
        assert!(method.contains("method GET not supported"), "{method}");
        // Where h2c is not served (the TLS port's http/1.1), the preface is named as such.
        assert!(H2_PREFACE.starts_with(H2_PREFACE_LINE));
        let preface = head_error(H2_PREFACE_LINE).await;
        assert!(preface.contains("HTTP/2 connection preface"), "{preface}");
    }

    /// On the plain port the HTTP/2 preface is recognised even when it arrives in pieces, and
    /// every byte read is kept for the gRPC front end; a CONNECT head is parsed as before.
    #[tokio::test]
    async fn plain_port_tells_the_http2_preface_from_a_connect_head() {
        let (mut client, mut server) = tokio::io::duplex(64);
        let sent = [H2_PREFACE, b"\x00\x00\x00\x04"].concat();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(5) {
                client.write_all(piece).await.expect("write");
                client.flush().await.expect("flush");
                tokio::task::yield_now().await;
            }
            client
        });
        match read_head(&mut server, true, true).await {
            Ok(Opening::H2c(read)) => {
                assert!(read.starts_with(H2_PREFACE), "{read:?}");
                assert!(H2_PREFACE.len() <= read.len() && read.len() <= H2_PREFACE.len() + 4);
            }
            Ok(Opening::Connect(..) | Opening::Dial(_)) => {
                panic!("the preface parsed as a CONNECT head")
            }
            Err(e) => panic!("preface refused: {}", e.message),
        }
        drop(writer.await.expect("writer"));
        let mut head: &[u8] = b"CONNECT c1:443 HTTP/1.1\r\n\r\nearly";
        match read_head(&mut head, true, true).await {
            Ok(Opening::Connect(h, early)) => {
                assert_eq!(h.target.expect("target").cluster, "c1");
                assert_eq!(&early[..], b"early");
            }
            Ok(Opening::H2c(_) | Opening::Dial(_)) => panic!("a CONNECT head taken for a preface"),
            Err(e) => panic!("CONNECT refused: {}", e.message),
        }
    }

    #[test]
    fn parse_head_is_pure_and_incremental() {
        let full =
            b"CONNECT 10.0.0.1.c1.tether:80 HTTP/1.1\r\nProxy-Authorization: Bearer t\r\n\r\nrest";
        for cut in 0..full.len() - 4 {
            assert!(
                parse_head(&full[..cut])
                    .expect("a prefix is no error")
                    .is_none()
            );
        }
        let (head, len) = parse_head(full).expect("valid").expect("complete");
        assert_eq!(&full[len..], b"rest");
        assert_eq!(head.credentials.as_deref(), Some("Bearer t"));
        assert!(head.trace.is_empty());
        assert_eq!(head.target.expect("target").wire_dest(), "10.0.0.1:80");
        let traced = b"CONNECT c1:443 HTTP/1.1\r\nTraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\ntracestate: v=1\r\nX-Other: 1\r\n\r\n";
        let (head, _) = parse_head(traced).expect("valid").expect("complete");
        assert_eq!(
            head.trace,
            [
                (
                    "Traceparent".to_owned(),
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned()
                ),
                ("tracestate".to_owned(), "v=1".to_owned()),
            ]
        );
        let bad = parse_head(b"CONNECT nope HTTP/1.1\r\n\r\n").expect("head parses");
        assert!(bad.expect("complete").0.target.is_err());
    }
}
