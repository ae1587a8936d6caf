//! `tether-tunnel/2`: the broker↔agent multiplexer with one task per hop.
//!
//! `tether-tunnel/1` runs HTTP/2 between broker and agent: every message crosses two tasks per
//! hop (the stream's pump hands it to the connection task, which frames, encrypts and writes;
//! the receiving connection task hands it to the stream's pump). `tether-frame-cost` measured
//! HTTP/2's framing and hand-offs at 10 µs more CPU per round trip than a plain length-prefixed
//! multiplexer (docs/proposals/tunnel-v2.md). This module is that multiplexer:
//!
//! - **Send path, no hand-off.** The task that read a socket frames its chunk and writes it to
//!   the TLS stream itself, under the connection's writer lock (a fair async mutex: streams take
//!   turns, one frame each). Frames that tasks without the lock must send (credits, pongs,
//!   resets from `Drop`) go to a bounded control queue that the next writer, or the
//!   connection's flusher (woken only then), writes.
//! - **Send path of a caller that cannot await** (the SDK's `AsyncWrite`): it waits in
//!   [`SendHalf::poll_writable`] until the writer is free with nothing queued, then writes its
//!   frame straight from its buffer without waiting ([`SendHalf::send_reserved_from`]); only
//!   what the socket does not take at once is copied and queued. A full socket therefore holds
//!   such writers back as a socket of their own would (woken together when the queue empties),
//!   instead of each copying its chunks into the queue up to its stream's window.
//! - **Receive path, one hand-off.** The connection's reader decrypts and parses, and appends a
//!   DATA frame's bytes to its stream's inbox (bounded by the stream's window: a peer that sends
//!   beyond it gets the stream reset), waking the stream's task, which writes them to its
//!   socket and returns credit. After a large DATA frame (read into an allocation of its own)
//!   the reader yields, so the woken task copies those bytes out while they are still in cache
//!   instead of after the reader has decrypted the frames behind it.
//! - **Opens.** `OPEN` carries the target, dial timeout, stream tag and trace context in a few
//!   dozen bytes; early data follows in the same write. The agent's handler is spawned by the
//!   reader itself ([`OnOpen`]). `OPEN_OK` / `OPEN_ERR` answer; `RESET` with code `Refused`
//!   (or a `GOAWAY` below the stream) means "not processed", which the broker retries elsewhere.
//! - **Flow control**: per-stream windows (the receiver's `WINDOW`, raised by the adaptive
//!   window), `CREDIT` once half a window was consumed; no connection window (the isolation rule
//!   of settings.rs: streams never block each other).
//!
//! Layout: [`frame`] (wire format, decoders that name the bad field), this file (connection,
//! streams, reader and flusher). Wire reference: docs/tunnel-protocol.md.

pub mod frame;

use std::collections::{HashMap, VecDeque};
use std::future::{Future, poll_fn};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use tether_bufpool::BufPool;

use crate::abort::AbortReason;
use frame::{FLAG_FIN, HEADER_LEN, Kind, ResetCode};

pub use frame::{Hello, Open, OpenOk};

/// Control frames (credits, pongs, resets) waiting for the socket. A peer that makes us queue
/// more — it sends and never reads — loses the connection.
pub const CONTROL_QUEUE_BYTES: usize = 1 << 20;
/// Connection events (hello, refusal, drain, goaway) waiting for the tunnel's owner.
pub const EVENT_QUEUE: usize = 32;
/// The reader's buffer while data flows (a read that fills half of the small buffer switches to
/// it).
pub const READ_BUFFER_BYTES: usize = 64 << 10;
/// The reader's buffer on an idle or lightly used connection (a fleet of idle tunnels holds
/// this, not [`READ_BUFFER_BYTES`], per connection).
pub const IDLE_READ_BUFFER_BYTES: usize = 2 << 10;
/// Most queued pieces one vectored write hands to TLS.
const MAX_WRITE_SLICES: usize = 16;
/// A DATA payload from this size up is read into an allocation of its own (kept by the stream's
/// inbox without a copy); smaller ones, and any that arrived inside a read of several frames,
/// are copied out of the read buffer, so a stalled stream's inbox never pins read buffers.
pub const COPY_BELOW: usize = 16 << 10;
/// Allocations of large DATA payloads a connection's reader keeps for reuse while data flows.
pub const LARGE_PAYLOAD_BUFFERS: usize = 8;

/// What [`Driver::run`] returns when the peer closed the connection cleanly.
pub const PEER_CLOSED: &str = "the peer closed the connection";

/// Which end of the tunnel this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Opens streams (the broker; odd stream ids).
    Opener,
    /// Accepts streams (the agent).
    Acceptor,
}

/// Limits of one connection.
#[derive(Debug, Clone)]
pub struct Config {
    /// Largest frame payload sent or accepted.
    pub max_frame_bytes: usize,
    /// The receive window announced for every stream.
    pub stream_window_bytes: u32,
    /// The receive window of the whole connection (bytes received and not yet written out,
    /// over all streams; the broker caps it per cluster, `budgets`).
    pub connection_window_bytes: u32,
    /// Most streams open at once (the acceptor refuses more).
    pub max_streams: usize,
}

impl Config {
    pub fn from_settings(s: &crate::TunnelSettings) -> Self {
        Self {
            max_frame_bytes: s.max_frame_bytes as usize,
            stream_window_bytes: s.stream_window_bytes,
            connection_window_bytes: s.connection_window_bytes,
            max_streams: s.max_concurrent_streams as usize,
        }
    }
}

/// Something the peer said about the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Hello(Hello),
    HelloOk { cluster: String, agent: String },
    Refused(String),
    Drain,
    GoAway { last: u32, reason: String },
}

/// How an open failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// The agent answered `OPEN_ERR` (its `DialErrorKind` label and message).
    Dial { kind: String, message: String },
    /// The agent did not process the stream (refused, or above its GOAWAY): nothing dialled.
    NotTaken(String),
    /// The connection failed with the stream taken.
    Lost(String),
}

/// Called by the reader for every accepted `OPEN` (the agent spawns its handler here).
pub type OnOpen = Arc<dyn Fn(Incoming) + Send + Sync>;

type Writer = Pin<Box<dyn AsyncWrite + Send>>;

struct Io {
    w: Writer,
    /// Bytes taken for writing, not yet accepted by the TLS stream.
    pending: VecDeque<Piece>,
}

/// Frames for the connection's next writer (or its flusher), in the order queued.
#[derive(Default)]
struct OutQueue {
    /// Frames queued without waiting for the writer (whole frames; DATA as header and payload).
    pieces: VecDeque<Piece>,
    /// Control frames queued after the last piece, appended in place (one allocation for many).
    tail: Vec<u8>,
    /// Bytes of control frames queued (bounded by [`CONTROL_QUEUE_BYTES`]; DATA queued here is
    /// bounded by the peer's windows: its credit was taken first).
    control_bytes: usize,
}

/// A piece of the write queue: a DATA frame's header (inline: no allocation per frame) or
/// bytes (whole frames, or a DATA payload).
enum Piece {
    Head { b: [u8; HEADER_LEN], at: u8 },
    Buf(Bytes),
}

impl Piece {
    fn bytes(&self) -> &[u8] {
        match self {
            Piece::Head { b, at } => &b[usize::from(*at)..],
            Piece::Buf(b) => b,
        }
    }
    fn advance(&mut self, n: usize) {
        match self {
            Piece::Head { at, .. } => *at += n as u8,
            Piece::Buf(b) => b.advance(n),
        }
    }
}

struct Streams {
    map: HashMap<u32, Arc<Stream>>,
    next_id: u32,
    /// Highest stream id the acceptor has seen.
    last_seen: u32,
    /// We sent GOAWAY: new OPENs are refused.
    going_away: bool,
    /// Why the connection ended.
    closed: Option<String>,
}

struct Shared {
    role: Role,
    cfg: Config,
    /// Frames waiting for the socket: control frames, and frames written without waiting
    /// ([`Shared::write_now`]) while another task held the writer. Lock order: `streams`, then
    /// `control` (an `OPEN` is queued under the table's lock, so ids leave in order).
    control: Mutex<OutQueue>,
    io: tokio::sync::Mutex<Io>,
    flush_wake: Notify,
    /// Tasks waiting for the writer to be free with nothing queued before them
    /// ([`SendHalf::poll_writable`]), woken all at once by the writer that leaves the queue
    /// empty (or by the connection's end). At most one waker per waiting task.
    writable: Mutex<Vec<Waker>>,
    /// `writable` is not empty: lets the writers that leave the queue empty (every frame, on
    /// the broker's and agent's paths where nobody waits there) skip its lock. Set under the
    /// lock before the waiter checks the writer again, read after the writer lets go (a
    /// sequentially consistent fence on each side, so one of the two sees the other).
    writable_waiting: AtomicBool,
    streams: Mutex<Streams>,
    /// The peer's receive window for each stream (our initial send credit).
    peer_window: AtomicU32,
    /// Our receive window for each stream.
    recv_window: AtomicU32,
    /// The peer's first WINDOW arrived.
    peer_window_known: AtomicBool,
    /// Most streams the peer accepts at once (its `WINDOW`).
    peer_max_streams: AtomicU32,
    /// Connection-level flow control (both directions).
    conn_flow: Mutex<ConnFlow>,
    /// The peer sent GOAWAY or DRAIN: no new streams go here. Set before the GOAWAY handler
    /// takes the stream table's lock, so an `OPEN` registered under that lock either sees it
    /// or is in the table the handler scans for streams above the peer's last.
    draining: AtomicBool,
    pong: Mutex<Option<([u8; 8], oneshot::Sender<()>)>>,
    closed: CancellationToken,
    /// Notified when a stream leaves the table (a draining agent waits for none).
    stream_gone: Notify,
    /// Notified when the peer's first `WINDOW` arrives (and when the connection ends).
    peer_known: Notify,
    /// The last `PING` payload sent (a counter: unique on the connection).
    ping_seq: AtomicU64,
    /// The credential of the latest `AUTH` (`tether-dial/1`: the client's).
    peer_auth: Mutex<Option<Arc<str>>>,
}

/// One end of a `tether-tunnel/2` connection. Cheap to clone.
#[derive(Clone)]
pub struct Mux {
    shared: Arc<Shared>,
}

/// Drives the connection (reads frames, flushes queued control frames); spawn it. It returns
/// why the connection ended, and every stream still open fails with that reason.
pub struct Driver {
    shared: Arc<Shared>,
    rd: Pin<Box<dyn AsyncRead + Send>>,
    events: mpsc::Sender<Event>,
    on_open: Option<OnOpen>,
}

/// An `OPEN` the acceptor took: what to dial, the stream, and how to answer.
pub struct Incoming {
    pub open: Open,
    /// The credential of the last `AUTH` before this `OPEN` (a `tether-dial/1` client's).
    pub auth: Option<Arc<str>>,
    pub responder: Responder,
    pub send: SendHalf,
    pub recv: RecvHalf,
}

/// Answers an incoming `OPEN`.
pub struct Responder {
    stream: Arc<Stream>,
}

#[derive(Default)]
struct ConnFlow {
    /// Bytes we may still send on the connection (the peer's connection window).
    send_credit: i64,
    /// Streams waiting for connection credit.
    waiting: Vec<Waker>,
    /// Bytes the peer may still send before it needs connection credit.
    recv_granted: i64,
    /// Bytes written out and not yet returned to the peer as connection credit.
    unreturned: u32,
}

struct Stream {
    id: u32,
    conn: Arc<Shared>,
    st: Mutex<StreamState>,
}

#[derive(Default)]
struct StreamState {
    inbox: VecDeque<Bytes>,
    /// Bytes the peer may still send before it needs credit.
    recv_granted: i64,
    /// Bytes written out by the receiver and not yet returned as credit.
    unreturned: u32,
    /// Bytes handed to the receiver and not yet released by it (given back to the connection
    /// window when the stream goes, as HTTP/2 does).
    outstanding: usize,
    recv_fin: bool,
    rx_waker: Option<Waker>,
    send_credit: i64,
    tx_waker: Option<Waker>,
    sent_fin: bool,
    /// Reset (by either side) or the connection ended.
    error: Option<AbortReason>,
    opened: Option<oneshot::Sender<Result<OpenOk, OpenError>>>,
    halves: u8,
}

impl StreamState {
    /// Empties the inbox; returns its bytes (the caller gives them back to the peer's
    /// connection window, after releasing this stream's lock).
    fn discard_inbox(&mut self) -> usize {
        let n = self.inbox.iter().map(Bytes::len).sum();
        self.inbox.clear();
        n
    }

    fn wake(&mut self) {
        if let Some(w) = self.rx_waker.take() {
            w.wake();
        }
        if let Some(w) = self.tx_waker.take() {
            w.wake();
        }
    }
}

/// The sending half of a stream.
pub struct SendHalf {
    stream: Arc<Stream>,
}

/// The receiving half of a stream.
pub struct RecvHalf {
    stream: Arc<Stream>,
}

fn lost(reason: &str) -> AbortReason {
    AbortReason::Tunnel(format!("tunnel connection lost: {reason}"))
}

/// Splits `io` (TLS, ALPN `tether-tunnel/2`) into the connection's handle, its driver, and the
/// receiver of its events. The caller sends its `WINDOW` first ([`Mux::start`] does).
pub fn connect<T>(
    io: T,
    role: Role,
    cfg: Config,
    on_open: Option<OnOpen>,
) -> (Mux, Driver, mpsc::Receiver<Event>)
where
    T: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, wr) = tokio::io::split(io);
    let (events_tx, events_rx) = mpsc::channel(EVENT_QUEUE);
    let window = cfg.stream_window_bytes;
    let shared = Arc::new(Shared {
        role,
        control: Mutex::new(OutQueue::default()),
        io: tokio::sync::Mutex::new(Io {
            w: Box::pin(wr),
            pending: VecDeque::new(),
        }),
        flush_wake: Notify::new(),
        writable: Mutex::new(Vec::new()),
        writable_waiting: AtomicBool::new(false),
        streams: Mutex::new(Streams {
            map: HashMap::new(),
            next_id: 1,
            last_seen: 0,
            going_away: false,
            closed: None,
        }),
        // Until the peer's WINDOW arrives (it is its first frame): HTTP/2's default.
        peer_window: AtomicU32::new(65_535),
        recv_window: AtomicU32::new(window),
        peer_window_known: AtomicBool::new(false),
        peer_max_streams: AtomicU32::new(u32::MAX),
        conn_flow: Mutex::new(ConnFlow {
            // Until the peer's WINDOW arrives (its first frame): HTTP/2's default.
            send_credit: 65_535,
            recv_granted: i64::from(cfg.connection_window_bytes),
            ..Default::default()
        }),
        draining: AtomicBool::new(false),
        pong: Mutex::new(None),
        closed: CancellationToken::new(),
        stream_gone: Notify::new(),
        peer_known: Notify::new(),
        ping_seq: AtomicU64::new(0),
        peer_auth: Mutex::new(None),
        cfg,
    });
    shared.queue(Kind::Window, 0, 0, &shared.window_payload(window));
    let mux = Mux {
        shared: Arc::clone(&shared),
    };
    let driver = Driver {
        shared,
        rd: Box::pin(rd),
        events: events_tx,
        on_open,
    };
    (mux, driver, events_rx)
}

impl Shared {
    /// `WINDOW`: the stream window, the connection window, the most streams accepted.
    fn window_payload(&self, stream_window: u32) -> [u8; 12] {
        let mut p = [0u8; 12];
        p[..4].copy_from_slice(&stream_window.to_be_bytes());
        p[4..8].copy_from_slice(&self.cfg.connection_window_bytes.to_be_bytes());
        let streams = u32::try_from(self.cfg.max_streams).unwrap_or(u32::MAX);
        p[8..].copy_from_slice(&streams.to_be_bytes());
        p
    }

    /// Appends a control frame to the queue and wakes the flusher (tasks that cannot wait).
    fn queue(&self, kind: Kind, flags: u8, stream: u32, payload: &[u8]) {
        let mut q = self.control.lock().expect("control queue");
        frame::put_frame(&mut q.tail, kind, flags, stream, payload);
        q.control_bytes += HEADER_LEN + payload.len();
        let over = q.control_bytes > CONTROL_QUEUE_BYTES;
        drop(q);
        if over {
            self.close(format!(
                "the peer does not read: more than {CONTROL_QUEUE_BYTES} bytes of control frames queued"
            ));
        }
        self.flush_wake.notify_one();
    }

    fn close(&self, reason: String) {
        let streams = {
            let mut s = self.streams.lock().expect("streams");
            if s.closed.is_none() {
                s.closed = Some(reason.clone());
            }
            std::mem::take(&mut s.map)
        };
        self.closed.cancel();
        self.stream_gone.notify_waiters();
        self.peer_known.notify_waiters();
        for (_, stream) in streams {
            let mut st = stream.st.lock().expect("stream");
            if st.error.is_none() {
                st.error = Some(lost(&reason));
            }
            if let Some(o) = st.opened.take() {
                let _ = o.send(Err(OpenError::Lost(reason.clone())));
            }
            st.wake();
        }
        if let Some((_, tx)) = self.pong.lock().expect("pong").take() {
            drop(tx);
        }
        self.wake_writable();
    }

    /// Wakes the tasks waiting in [`SendHalf::poll_writable`]: called by every writer that
    /// lets go of the writer with nothing left queued, and when the connection ends.
    fn wake_writable(&self) {
        // Pairs with the fence in `poll_writable`: the writer let go, then looks for waiters;
        // a waiter registers, then looks at the writer.
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.writable_waiting.load(Ordering::SeqCst) {
            return;
        }
        let waiting = {
            let mut w = self.writable.lock().expect("writable");
            self.writable_waiting.store(false, Ordering::SeqCst);
            std::mem::take(&mut *w)
        };
        for w in waiting {
            w.wake();
        }
    }

    /// Whether a frame written now goes straight to the socket: the writer is free and nothing
    /// waits before it.
    fn writer_free(&self) -> bool {
        let free = self.io.try_lock().is_ok_and(|io| io.pending.is_empty());
        if free {
            // This probe held the writer for a moment: another task's probe may have found it
            // busy then and be waiting for a writer to let go.
            self.wake_writable();
        }
        free && self
            .control
            .lock()
            .expect("control queue")
            .pieces
            .is_empty()
    }

    /// Ready once [`Self::writer_free`]; else registers `cx` to be woken when it may be.
    fn poll_writable(&self, cx: &mut Context<'_>) -> Poll<Result<(), AbortReason>> {
        if self.closed.is_cancelled() {
            return Poll::Ready(Err(lost(&self.closed_reason())));
        }
        if self.writer_free() {
            return Poll::Ready(Ok(()));
        }
        {
            let mut waiting = self.writable.lock().expect("writable");
            if !waiting.iter().any(|w| w.will_wake(cx.waker())) {
                waiting.push(cx.waker().clone());
            }
            self.writable_waiting.store(true, Ordering::SeqCst);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        // Registered first, then checked again: a writer that let go in between is seen here
        // (the waker stays registered: one spurious wake-up at most).
        if self.closed.is_cancelled() {
            return Poll::Ready(Err(lost(&self.closed_reason())));
        }
        if self.writer_free() {
            return Poll::Ready(Ok(()));
        }
        Poll::Pending
    }

    fn closed_reason(&self) -> String {
        self.streams
            .lock()
            .expect("streams")
            .closed
            .clone()
            .unwrap_or_else(|| "closed".into())
    }

    /// Writes `frames` (whole frames, built by the caller) and everything queued before them,
    /// under the writer lock; cancel-safe (bytes not written stay queued for the flusher).
    async fn write(&self, frames: Bytes) -> Result<(), AbortReason> {
        self.write_pieces([Piece::Buf(frames)]).await
    }

    /// [`Self::write`] of a DATA frame: its inline header, then its payload.
    async fn write_data(&self, head: [u8; HEADER_LEN], payload: Bytes) -> Result<(), AbortReason> {
        self.write_pieces([Piece::Head { b: head, at: 0 }, Piece::Buf(payload)])
            .await
    }

    async fn write_pieces(
        &self,
        pieces: impl IntoIterator<Item = Piece>,
    ) -> Result<(), AbortReason> {
        if self.closed.is_cancelled() {
            return Err(lost(&self.closed_reason()));
        }
        let work = async {
            let mut io = self.io.lock().await;
            self.take_control(&mut io);
            io.pending
                .extend(pieces.into_iter().filter(|p| !p.bytes().is_empty()));
            let mut guard = FlushOnDrop(self, false);
            let r = flush(&mut io).await;
            guard.1 = true;
            drop(io);
            if r.is_ok() {
                self.wake_writable();
            }
            r
        };
        let r = tokio::select! {
            biased;
            r = work => r,
            () = self.closed.cancelled() => return Err(lost(&self.closed_reason())),
        };
        r.map_err(|e| {
            let reason = format!("writing to the peer: {e}");
            self.close(reason.clone());
            lost(&reason)
        })
    }

    /// Returns `n` bytes to the peer's connection window (credit on stream 0 once half the
    /// window is owed).
    fn release_connection(&self, n: usize) {
        if n == 0 {
            return;
        }
        let owed = {
            let mut c = self.conn_flow.lock().expect("connection flow");
            c.unreturned = c.unreturned.saturating_add(n as u32);
            if c.unreturned < self.cfg.connection_window_bytes / 2 {
                return;
            }
            let owed = std::mem::take(&mut c.unreturned);
            c.recv_granted += i64::from(owed);
            owed
        };
        self.queue(Kind::Credit, 0, 0, &owed.to_be_bytes());
    }

    fn take_control(&self, io: &mut Io) {
        let mut q = self.control.lock().expect("control queue");
        io.pending.extend(q.pieces.drain(..));
        if !q.tail.is_empty() {
            io.pending
                .push_back(Piece::Buf(Bytes::from(std::mem::take(&mut q.tail))));
        }
        q.control_bytes = 0;
    }

    /// Queues `pieces` behind everything queued for the next writer (or the flusher).
    fn defer(&self, pieces: impl IntoIterator<Item = Piece>) {
        self.enqueue_all(pieces);
        self.flush_wake.notify_one();
    }

    /// Queues `piece` for the next writer without waking the flusher (the caller writes or
    /// wakes it next).
    fn enqueue(&self, piece: Piece) {
        self.enqueue_all([piece]);
    }

    fn enqueue_all(&self, pieces: impl IntoIterator<Item = Piece>) {
        let mut q = self.control.lock().expect("control queue");
        if !q.tail.is_empty() {
            let tail = Bytes::from(std::mem::take(&mut q.tail));
            q.pieces.push_back(Piece::Buf(tail));
        }
        q.pieces.extend(pieces);
    }

    /// A write error ends the connection.
    fn write_failed(&self, e: &io::Error) -> AbortReason {
        let reason = format!("writing to the peer: {e}");
        self.close(reason.clone());
        lost(&reason)
    }

    /// A DATA frame written without waiting, straight from the caller's buffer when the writer
    /// is free and nothing is queued before it (no copy: the kernel, or TLS, takes the bytes
    /// from `data`); what the socket does not take now, or the whole frame when the writer is
    /// busy or frames wait before it, is copied with `copy` and queued.
    ///
    /// The payload may come in several slices (a vectored write): they go out as one frame.
    fn write_data_now(
        &self,
        head: [u8; HEADER_LEN],
        data: &[&[u8]],
        copy: impl FnOnce(&[u8]) -> Bytes,
    ) -> Result<(), AbortReason> {
        if self.closed.is_cancelled() {
            return Err(lost(&self.closed_reason()));
        }
        let Ok(mut io) = self.io.try_lock() else {
            self.defer([
                Piece::Head { b: head, at: 0 },
                Piece::Buf(copy_tail(data, 0, copy)),
            ]);
            return Ok(());
        };
        self.take_control(&mut io);
        if !io.pending.is_empty() {
            // Frames wait before this one (queued while the writer was busy): out with them
            // first, so this one may still go straight from the caller's buffer.
            let flushed = {
                let flushing = flush(&mut io);
                std::pin::pin!(flushing).poll(&mut Context::from_waker(Waker::noop()))
            };
            if let Poll::Ready(Err(e)) = flushed {
                drop(io);
                return Err(self.write_failed(&e));
            }
        }
        let written = if io.pending.is_empty() {
            match write_direct(&mut io, &head, data) {
                Ok(n) => n,
                Err(e) => {
                    drop(io);
                    return Err(self.write_failed(&e));
                }
            }
        } else {
            0
        };
        let len: usize = data.iter().map(|d| d.len()).sum();
        if written < HEADER_LEN {
            let at = written as u8;
            io.pending.push_back(Piece::Head { b: head, at });
            io.pending.push_back(Piece::Buf(copy_tail(data, 0, copy)));
        } else if written < HEADER_LEN + len {
            io.pending
                .push_back(Piece::Buf(copy_tail(data, written - HEADER_LEN, copy)));
        }
        self.flush_now(io)
    }

    /// Writes `pieces` without waiting: at once when the writer is free (what the socket does
    /// not take now is left to the flusher), else queued behind the frames before them for the
    /// task holding the writer or the flusher, which write everything queued in one go (a burst
    /// of opens or answers leaves in a few writes, not one each).
    fn write_now(&self, pieces: impl IntoIterator<Item = Piece>) -> Result<(), AbortReason> {
        if self.closed.is_cancelled() {
            return Err(lost(&self.closed_reason()));
        }
        let pieces = pieces.into_iter().filter(|p| !p.bytes().is_empty());
        let Ok(mut io) = self.io.try_lock() else {
            self.defer(pieces);
            return Ok(());
        };
        self.take_control(&mut io);
        io.pending.extend(pieces);
        self.flush_now(io)
    }

    /// One non-blocking pass of [`flush`] under the writer lock; what the socket does not take
    /// now is left to the flusher.
    fn flush_now(&self, mut io: tokio::sync::MutexGuard<'_, Io>) -> Result<(), AbortReason> {
        let polled = {
            let flushing = flush(&mut io);
            std::pin::pin!(flushing).poll(&mut Context::from_waker(Waker::noop()))
        };
        drop(io);
        match polled {
            Poll::Ready(Ok(())) => {
                self.wake_writable();
                Ok(())
            }
            Poll::Ready(Err(e)) => Err(self.write_failed(&e)),
            Poll::Pending => {
                self.flush_wake.notify_one();
                Ok(())
            }
        }
    }

    /// Sets `which` (the window a new stream starts with) to `window` and changes every open
    /// stream by the difference, in one step under the stream table's lock, where streams are
    /// created: a stream opened meanwhile is either in the table and changed, or starts with
    /// the new window — never both (credit twice: an opener that dialed right after the peer's
    /// first `WINDOW` sent a window beyond the broker's and was reset) nor neither.
    fn change_windows(
        &self,
        which: &AtomicU32,
        window: u32,
        apply: impl Fn(&mut StreamState, i64),
    ) {
        let s = self.streams.lock().expect("streams");
        let old = which.swap(window, Ordering::Relaxed);
        let delta = i64::from(window) - i64::from(old);
        for stream in s.map.values() {
            apply(&mut stream.st.lock().expect("stream"), delta);
        }
    }

    fn stream(&self, id: u32) -> Option<Arc<Stream>> {
        self.streams.lock().expect("streams").map.get(&id).cloned()
    }

    fn new_stream(self: &Arc<Self>, id: u32) -> Arc<Stream> {
        Arc::new(Stream {
            id,
            conn: Arc::clone(self),
            st: Mutex::new(StreamState {
                recv_granted: i64::from(self.recv_window.load(Ordering::Relaxed)),
                send_credit: i64::from(self.peer_window.load(Ordering::Relaxed)),
                halves: 2,
                ..Default::default()
            }),
        })
    }
}

/// Wakes the flusher when a write is dropped before its bytes went out.
struct FlushOnDrop<'a>(&'a Shared, bool);

impl Drop for FlushOnDrop<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.flush_wake.notify_one();
        }
    }
}

/// The bytes of `data` (a payload in slices) after the first `skip`, as one owned chunk: `copy`
/// of the rest of one slice, or (spanning slices, the rarer case) a new buffer.
fn copy_tail(data: &[&[u8]], mut skip: usize, copy: impl FnOnce(&[u8]) -> Bytes) -> Bytes {
    let mut rest: Vec<&[u8]> = Vec::new();
    for d in data {
        if skip >= d.len() {
            skip -= d.len();
            continue;
        }
        rest.push(&d[skip..]);
        skip = 0;
    }
    match rest.as_slice() {
        [] => Bytes::new(),
        [one] => copy(one),
        many => Bytes::from(many.concat()),
    }
}

/// Writes `head` and `data` (the payload, in slices) from the caller's buffers as far as the
/// socket takes them now (nothing queued before them); returns how many bytes went.
fn write_direct(io: &mut Io, head: &[u8; HEADER_LEN], data: &[&[u8]]) -> io::Result<usize> {
    let mut cx = Context::from_waker(Waker::noop());
    let total = HEADER_LEN + data.iter().map(|d| d.len()).sum::<usize>();
    let mut written = 0;
    while written < total {
        let mut slices = [io::IoSlice::new(&[]); MAX_WRITE_SLICES];
        let mut k = 0;
        let mut skip = written;
        for part in std::iter::once(&head[..]).chain(data.iter().copied()) {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            if k == MAX_WRITE_SLICES {
                break;
            }
            slices[k] = io::IoSlice::new(&part[skip..]);
            skip = 0;
            k += 1;
        }
        match io.w.as_mut().poll_write_vectored(&mut cx, &slices[..k]) {
            Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(k)) => written += k,
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => break,
        }
    }
    Ok(written)
}

/// Lets the tasks woken so far run before the caller goes on: returns `Pending` once, having
/// woken itself, so the runtime queues the caller behind them. Unlike `tokio::task::yield_now`
/// it does not wait for the runtime to poll its I/O driver first (one more `epoll_wait` per
/// call).
fn woken_tasks_first() -> impl Future<Output = ()> {
    let mut yielded = false;
    poll_fn(move |cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
}

/// Writes every queued piece (several per vectored write: a frame's header and payload end up
/// in one TLS record and one `send`), then flushes.
async fn flush(io: &mut Io) -> io::Result<()> {
    while !io.pending.is_empty() {
        let n = {
            let mut slices = [io::IoSlice::new(&[]); MAX_WRITE_SLICES];
            let mut k = 0;
            for (slot, piece) in slices.iter_mut().zip(io.pending.iter()) {
                *slot = io::IoSlice::new(piece.bytes());
                k += 1;
            }
            io.w.write_vectored(&slices[..k]).await?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let mut left = n;
        while left > 0 {
            let front = io.pending.front_mut().expect("written bytes were queued");
            let k = left.min(front.bytes().len());
            front.advance(k);
            left -= k;
            if front.bytes().is_empty() {
                io.pending.pop_front();
            }
        }
    }
    io.w.flush().await
}

fn frame_bytes(kind: Kind, flags: u8, stream: u32, payload: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
    frame::put_frame(&mut v, kind, flags, stream, payload);
    Bytes::from(v)
}

impl Mux {
    /// Which end this is.
    pub fn role(&self) -> Role {
        self.shared.role
    }

    /// Most streams the peer accepts at once (as it announced; unbounded until it did).
    pub fn peer_max_streams(&self) -> usize {
        self.shared.peer_max_streams.load(Ordering::Relaxed) as usize
    }

    /// Waits for the peer's first frame (its `WINDOW`): the peer speaks this protocol. An error
    /// names why the connection ended first.
    pub async fn peer_known(&self) -> Result<(), String> {
        loop {
            let known = self.shared.peer_known.notified();
            tokio::pin!(known);
            known.as_mut().enable();
            if self.shared.peer_window_known.load(Ordering::Relaxed) {
                return Ok(());
            }
            if self.is_closed() {
                return Err(self.shared.closed_reason());
            }
            known.await;
        }
    }

    /// Whether `other` is a handle of the same connection.
    pub fn same_connection(&self, other: &Mux) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.shared.streams.lock().expect("streams").map.len()
    }

    /// The peer sent GOAWAY (or this broker's agent is closing the tunnel): no new streams.
    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Relaxed)
    }

    /// Waits until no stream is open (or the connection ended).
    pub async fn idle(&self) {
        loop {
            let gone = self.shared.stream_gone.notified();
            tokio::pin!(gone);
            gone.as_mut().enable();
            if self.open_streams() == 0 || self.is_closed() {
                return;
            }
            gone.await;
        }
    }

    /// The connection ended (or [`Mux::close`] was called).
    pub fn is_closed(&self) -> bool {
        self.shared.closed.is_cancelled()
    }

    /// Ends the connection now: every open stream fails with `reason`; the driver returns.
    pub fn close(&self, reason: impl Into<String>) {
        self.shared.close(reason.into());
    }

    /// Sends a connection frame (`HELLO`, `HELLO_OK`, `REFUSED`, `DRAIN`).
    pub async fn send_control(&self, kind: Kind, payload: &[u8]) -> Result<(), AbortReason> {
        self.shared.write(frame_bytes(kind, 0, 0, payload)).await
    }

    /// Acceptor: take no stream above the last one seen, tell the peer.
    pub async fn go_away(&self, reason: &str) -> Result<(), AbortReason> {
        let last = {
            let mut s = self.shared.streams.lock().expect("streams");
            s.going_away = true;
            s.last_seen
        };
        self.send_control(Kind::GoAway, &frame::encode_goaway(last, reason))
            .await
    }

    /// Announces a new receive window for every stream (the adaptive window changed).
    pub fn set_recv_window(&self, window: u32) {
        self.shared
            .change_windows(&self.shared.recv_window, window, |st, delta| {
                st.recv_granted += delta;
            });
        self.shared
            .queue(Kind::Window, 0, 0, &self.shared.window_payload(window));
    }

    /// Sends a PING and waits for its PONG (the caller bounds the wait).
    ///
    /// The PING is written without waiting for the writer ([`Shared::write_now`]: what the
    /// socket does not take now goes with the next writer or the flusher), so this future never
    /// holds the writer while it waits. A keepalive future is pinned beside other work in a
    /// tunnel's loop, and that loop awaits writes of its own (GOAWAY on shutdown): a PING
    /// parked mid-write with the writer held would block them, and every other frame, until
    /// the loop polled it again — a tunnel that stopped sending at the agent's SIGTERM while
    /// its socket was full (seen with `TCP_NOTSENT_LOWAT`, where a full socket is common).
    pub async fn ping(&self) -> Result<(), AbortReason> {
        let payload = (self.shared.ping_seq.fetch_add(1, Ordering::Relaxed) + 1).to_be_bytes();
        let (tx, rx) = oneshot::channel();
        *self.shared.pong.lock().expect("pong") = Some((payload, tx));
        self.shared
            .write_now([Piece::Buf(frame_bytes(Kind::Ping, 0, 0, &payload))])?;
        rx.await.map_err(|_| lost(&self.shared.closed_reason()))
    }

    /// Opener: opens a stream for `open`; `early` (the client's first bytes) leaves in the same
    /// write as the `OPEN` and counts against the stream's window. Waits for the agent's answer
    /// (the caller bounds the wait; dropping the future resets the stream).
    pub async fn open(
        &self,
        open: &Open,
        early: &Bytes,
    ) -> Result<(SendHalf, RecvHalf), OpenError> {
        let (send, recv, _) = self.open_answered(open, early).await?;
        Ok((send, recv))
    }

    /// [`Mux::open`], returning the `OPEN_OK`'s payload too (a broker's answer to a
    /// `tether-dial/1` client carries the stream id and the tunnel's round trip).
    pub async fn open_answered(
        &self,
        open: &Open,
        early: &Bytes,
    ) -> Result<(SendHalf, RecvHalf, OpenOk), OpenError> {
        let shared = &self.shared;
        let payload = open.encode();
        let (stream, rx) = {
            let mut s = shared.streams.lock().expect("streams");
            if let Some(reason) = &s.closed {
                return Err(OpenError::NotTaken(format!(
                    "the tunnel connection is closed: {reason}"
                )));
            }
            if shared.draining.load(Ordering::Relaxed) {
                return Err(OpenError::NotTaken(
                    "the peer is closing this connection (GOAWAY or DRAIN)".into(),
                ));
            }
            let id = s.next_id;
            if id > (1 << 31) {
                return Err(OpenError::NotTaken(
                    "stream ids of this tunnel connection are exhausted".into(),
                ));
            }
            s.next_id += 2;
            let stream = shared.new_stream(id);
            let (tx, rx) = oneshot::channel();
            {
                let mut st = stream.st.lock().expect("stream");
                st.opened = Some(tx);
                st.send_credit -= early.len() as i64;
            }
            s.map.insert(id, Arc::clone(&stream));
            let mut out = Vec::with_capacity(2 * HEADER_LEN + payload.len() + early.len());
            frame::put_frame(&mut out, Kind::Open, 0, id, &payload);
            if !early.is_empty() {
                frame::put_frame(&mut out, Kind::Data, 0, id, early);
            }
            // Queued under the table's lock: OPENs leave in the order of their ids, which the
            // acceptor requires (two opens racing for the writer would otherwise swap them).
            shared.enqueue(Piece::Buf(Bytes::from(out)));
            (stream, rx)
        };
        let send = SendHalf {
            stream: Arc::clone(&stream),
        };
        let recv = RecvHalf {
            stream: Arc::clone(&stream),
        };
        // Written now if the writer is free, else by its holder or the flusher.
        if let Err(e) = shared.write_now([]) {
            // The OPEN may have left before the connection failed: the agent may have dialled.
            return Err(OpenError::Lost(e.to_string()));
        }
        match rx.await {
            Ok(Ok(answer)) => Ok((send, recv, answer)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(OpenError::Lost(shared.closed_reason())),
        }
    }
}

impl Responder {
    /// The dial succeeded.
    pub async fn ok(self) -> Result<(), AbortReason> {
        self.answer(frame_bytes(Kind::OpenOk, 0, self.stream.id, &[]))
    }

    /// Answers without waiting for the writer (a burst of answers leaves together).
    fn answer(&self, frame: Bytes) -> Result<(), AbortReason> {
        self.stream.conn.write_now([Piece::Buf(frame)])
    }

    /// The dial succeeded; a broker tells its `tether-dial/1` client the stream id and the
    /// tunnel's round trip.
    pub async fn ok_with(self, answer: OpenOk) -> Result<(), AbortReason> {
        self.answer(frame_bytes(
            Kind::OpenOk,
            0,
            self.stream.id,
            &answer.encode(),
        ))
    }

    /// The dial failed: the stream is over.
    pub async fn fail(self, kind_label: &str, message: &str) -> Result<(), AbortReason> {
        {
            let mut st = self.stream.st.lock().expect("stream");
            st.sent_fin = true;
            st.recv_fin = true;
        }
        self.answer(frame_bytes(
            Kind::OpenErr,
            0,
            self.stream.id,
            &frame::encode_open_err(kind_label, message),
        ))
    }

    /// Not processed (nothing dialled): the opener sees [`OpenError::NotTaken`] and may open
    /// the stream elsewhere — what a closing peer answers to an `OPEN` that crossed its
    /// GOAWAY.
    pub fn refuse(self, reason: &str) {
        self.stream.reset(ResetCode::Refused, reason);
    }
}

impl SendHalf {
    /// Sends `data`, waiting for the stream's credit (the peer's window: the backpressure).
    pub async fn send(&mut self, mut data: Bytes) -> Result<(), AbortReason> {
        let max = self.stream.conn.cfg.max_frame_bytes;
        while !data.is_empty() {
            let want = data.len().min(max);
            let n = poll_fn(|cx| self.poll_credit(cx, want)).await?;
            let part = data.split_to(n);
            let head = frame::header(Kind::Data, 0, self.stream.id, part.len());
            self.stream.conn.write_data(head, part).await?;
        }
        Ok(())
    }

    /// The poll form of [`SendHalf::send`], for a caller that cannot hold a future per chunk
    /// (the SDK's `AsyncWrite`): ready with how many bytes (1 to `want`, at most a frame) the
    /// stream may send now. That credit is taken: send the bytes with
    /// [`SendHalf::send_reserved`] next.
    pub fn poll_reserve(
        &mut self,
        cx: &mut Context<'_>,
        want: usize,
    ) -> Poll<Result<usize, AbortReason>> {
        let max = self.stream.conn.cfg.max_frame_bytes;
        self.poll_credit(cx, want.clamp(1, max))
    }

    /// Ready once a frame sent now ([`SendHalf::send_reserved_from`]) would go straight to the
    /// socket: the connection's writer is free and nothing is queued before it. A caller that
    /// cannot hold a future per chunk (the SDK's `AsyncWrite`) waits here before taking credit,
    /// so that a full socket holds it back instead of its bytes being copied and queued: the
    /// connection's backpressure, as a socket's own. Without it, while the socket is full every
    /// stream's chunk is copied into the queue, up to each stream's window (8 streams on one
    /// connection: many MiB queued, a copy per byte, and a small message behind all of it).
    pub fn poll_writable(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), AbortReason>> {
        self.stream.conn.poll_writable(cx)
    }

    /// [`SendHalf::poll_reserve`] without waiting: the credit available now (0: none).
    pub fn try_reserve(&mut self, want: usize) -> Result<usize, AbortReason> {
        match self.poll_reserve(&mut Context::from_waker(Waker::noop()), want) {
            Poll::Ready(r) => r,
            Poll::Pending => Ok(0),
        }
    }

    /// Sends `data`, bytes granted by [`SendHalf::poll_reserve`], without waiting: written at
    /// once when the connection's writer is free, else queued for the task holding it (or the
    /// flusher). What may be queued is bounded by the credit taken.
    pub fn send_reserved(&mut self, data: Bytes) -> Result<(), AbortReason> {
        // What must wait is kept as a slice of `data`, not copied.
        self.send_reserved_from(&data, |rest| data.slice_ref(rest))
    }

    /// [`SendHalf::send_reserved`] from a borrowed buffer: written straight from `data` when
    /// the connection's writer is free (no copy), else copied with `copy` and queued.
    pub fn send_reserved_from(
        &mut self,
        data: &[u8],
        copy: impl FnOnce(&[u8]) -> Bytes,
    ) -> Result<(), AbortReason> {
        if data.is_empty() {
            return Ok(());
        }
        if let Some(e) = &self.stream.st.lock().expect("stream").error {
            return Err(e.clone());
        }
        let head = frame::header(Kind::Data, 0, self.stream.id, data.len());
        self.stream.conn.write_data_now(head, &[data], copy)
    }

    /// [`SendHalf::send_reserved_from`] for a payload in slices (a vectored write, at most
    /// the credit taken): one frame, written straight from the slices (TLS builds its records
    /// across them), a copy only for what must wait.
    pub fn send_reserved_vectored(&mut self, data: &[&[u8]]) -> Result<(), AbortReason> {
        let len: usize = data.iter().map(|d| d.len()).sum();
        if len == 0 {
            return Ok(());
        }
        if let Some(e) = &self.stream.st.lock().expect("stream").error {
            return Err(e.clone());
        }
        let head = frame::header(Kind::Data, 0, self.stream.id, len);
        self.stream
            .conn
            .write_data_now(head, data, Bytes::copy_from_slice)
    }

    /// [`SendHalf::finish`] without waiting (the FIN goes behind everything sent before).
    pub fn finish_now(&mut self) -> Result<(), AbortReason> {
        {
            let mut st = self.stream.st.lock().expect("stream");
            if let Some(e) = &st.error {
                return Err(e.clone());
            }
            st.sent_fin = true;
        }
        let fin = frame_bytes(Kind::Data, FLAG_FIN, self.stream.id, &[]);
        self.stream.conn.write_now([Piece::Buf(fin)])
    }

    fn poll_credit(&self, cx: &mut Context<'_>, want: usize) -> Poll<Result<usize, AbortReason>> {
        let mut st = self.stream.st.lock().expect("stream");
        if let Some(e) = &st.error {
            return Poll::Ready(Err(e.clone()));
        }
        if st.send_credit <= 0 {
            st.tx_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let mut conn = self.stream.conn.conn_flow.lock().expect("connection flow");
        if conn.send_credit <= 0 {
            conn.waiting.push(cx.waker().clone());
            return Poll::Pending;
        }
        let n = (st.send_credit.min(conn.send_credit) as usize).min(want);
        st.send_credit -= n as i64;
        conn.send_credit -= n as i64;
        Poll::Ready(Ok(n))
    }

    /// Ends this direction (FIN) after the bytes sent before.
    pub async fn finish(&mut self) -> Result<(), AbortReason> {
        {
            let mut st = self.stream.st.lock().expect("stream");
            if let Some(e) = &st.error {
                return Err(e.clone());
            }
            st.sent_fin = true;
        }
        self.stream
            .conn
            .write(frame_bytes(Kind::Data, FLAG_FIN, self.stream.id, &[]))
            .await
    }

    /// Aborts the stream (both directions): the peer sees a reset.
    pub fn reset(&mut self) {
        self.stream.reset(ResetCode::Cancel, "cancelled");
    }

    /// Ready when the stream was reset or the connection lost.
    pub fn poll_reset(&mut self, cx: &mut Context<'_>) -> Poll<AbortReason> {
        let mut st = self.stream.st.lock().expect("stream");
        match &st.error {
            Some(e) => Poll::Ready(e.clone()),
            None => {
                st.tx_waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl RecvHalf {
    /// The next bytes; `None` after the peer's FIN; an error when the stream was reset or the
    /// connection lost.
    pub async fn data(&mut self) -> Option<Result<Bytes, AbortReason>> {
        poll_fn(|cx| self.poll_data(cx)).await
    }

    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, AbortReason>>> {
        let mut st = self.stream.st.lock().expect("stream");
        // Bytes that arrived are delivered even when the connection ended after them (a reset
        // clears them); a stream whose FIN arrived ended cleanly whatever happens next.
        if let Some(b) = st.inbox.pop_front() {
            st.outstanding += b.len();
            return Poll::Ready(Some(Ok(b)));
        }
        if st.recv_fin {
            return Poll::Ready(None);
        }
        if let Some(e) = &st.error {
            return Poll::Ready(Some(Err(e.clone())));
        }
        st.rx_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// The peer's FIN arrived and every byte before it was read.
    pub fn is_end_stream(&self) -> bool {
        let st = self.stream.st.lock().expect("stream");
        st.recv_fin && st.inbox.is_empty() && st.error.is_none()
    }

    /// Returns `n` bytes (written out by the caller) to the peer's window; credit goes out once
    /// half a window is owed.
    pub fn release(&mut self, n: usize) {
        let window = self.stream.conn.recv_window.load(Ordering::Relaxed);
        let (n, owed) = {
            let mut st = self.stream.st.lock().expect("stream");
            let n = n.min(st.outstanding);
            st.outstanding -= n;
            st.unreturned = st.unreturned.saturating_add(n as u32);
            let owed = if st.unreturned < window / 2 || st.recv_fin || st.error.is_some() {
                0
            } else {
                let owed = std::mem::take(&mut st.unreturned);
                st.recv_granted += i64::from(owed);
                owed
            };
            (n, owed)
        };
        self.stream.conn.release_connection(n);
        if owed > 0 {
            self.stream
                .conn
                .queue(Kind::Credit, 0, self.stream.id, &owed.to_be_bytes());
        }
    }
}

impl Stream {
    fn reset(&self, code: ResetCode, message: &str) {
        let discarded = {
            let mut st = self.st.lock().expect("stream");
            if st.error.is_some() || (st.sent_fin && st.recv_fin) {
                return;
            }
            st.error = Some(AbortReason::Cancelled(message.to_owned()));
            st.wake();
            st.discard_inbox()
        };
        self.conn.release_connection(discarded);
        self.conn
            .queue(Kind::Reset, 0, self.id, &frame::encode_reset(code, message));
    }

    fn half_dropped(&self) {
        let last = {
            let mut st = self.st.lock().expect("stream");
            st.halves -= 1;
            st.halves == 0
        };
        if last {
            // A stream dropped before both directions ended is aborted.
            self.reset(ResetCode::Cancel, "stream dropped");
            // Bytes nobody will read or release go back to the peer's connection window.
            let unread = {
                let mut st = self.st.lock().expect("stream");
                st.discard_inbox() + std::mem::take(&mut st.outstanding)
            };
            self.conn.release_connection(unread);
            self.conn
                .streams
                .lock()
                .expect("streams")
                .map
                .remove(&self.id);
            self.conn.stream_gone.notify_waiters();
        }
    }
}

impl Drop for SendHalf {
    fn drop(&mut self) {
        self.stream.half_dropped();
    }
}

impl Drop for RecvHalf {
    fn drop(&mut self) {
        self.stream.half_dropped();
    }
}

/// Ends the connection when the driver's future is dropped (its task aborted).
struct CloseOnDrop(Arc<Shared>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if !self.0.closed.is_cancelled() {
            self.0.close("the tunnel connection's task ended".into());
        }
    }
}

/// A protocol error of the peer: the connection ends with it.
#[derive(Debug)]
struct ConnError(String);

impl From<frame::FrameError> for ConnError {
    fn from(e: frame::FrameError) -> Self {
        Self(format!("malformed frame from the peer: {e}"))
    }
}

impl Driver {
    /// Runs until the connection ends; returns why. Dropping the future ends the connection
    /// too (its streams fail, as when an HTTP/2 connection is dropped).
    pub async fn run(mut self) -> String {
        let shared = Arc::clone(&self.shared);
        let _close = CloseOnDrop(Arc::clone(&shared));
        let reason = tokio::select! {
            r = self.read_loop() => match r {
                Ok(()) => PEER_CLOSED.to_owned(),
                Err(ConnError(e)) => e,
            },
            e = flusher(&shared) => format!("writing to the peer: {e}"),
            () = shared.closed.cancelled() => shared.closed_reason(),
        };
        shared.close(reason.clone());
        // Close cleanly: TLS close_notify and FIN, lingering for the peer's EOF (bounded by the
        // transport's lingering close). Writers give the lock up at once (the connection is
        // closed); the socket is shut even while streams still hold the connection.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            let mut io = shared.io.lock().await;
            io.w.shutdown().await
        })
        .await;
        reason
    }

    async fn read_loop(&mut self) -> Result<(), ConnError> {
        let max = self.shared.cfg.max_frame_bytes;
        let mut buf = BytesMut::new();
        // Reads are large while data flows, small otherwise.
        let mut flowing = false;
        // Allocations of large DATA payloads, recycled once their stream has written them out
        // (a fresh 256 KiB allocation per frame cost the agent page faults and allocator work);
        // released with the large read buffer when a burst ends — at the first read that finds
        // little, at the latest with the next keepalive PING or PONG.
        let pool = BufPool::new(LARGE_PAYLOAD_BUFFERS);
        // A large DATA frame whose payload is being read into an allocation of its own (at
        // least the payload's size): the stream's inbox keeps it without a copy and pins
        // nothing else.
        let mut large: Option<(frame::Header, Vec<u8>)> = None;
        // A large frame just ended: the next read takes only a header, so that a large frame
        // behind it is read straight into its own allocation (not partly into `buf` and copied).
        let mut header_only = false;
        loop {
            if let Some((h, own)) = &large
                && own.len() == h.len
            {
                let (h, own) = large.take().expect("large frame");
                header_only = true;
                self.on_frame(h, pool.lend(own), true)?;
                // The stream's task writes this payload out before the next frame is read,
                // while its bytes are still in cache. Read ahead instead, the reader decrypts
                // frame after frame (as far as the stream's window lets the peer send) into
                // buffers that have left the cache by the time the task copies them to its
                // socket: docs/benchmarks.md, the forty-first machine.
                woken_tasks_first().await;
            }
            while large.is_none() && buf.len() >= HEADER_LEN {
                let h = frame::parse_header(buf[..HEADER_LEN].try_into().expect("header"), max)?;
                let need = HEADER_LEN + h.len;
                if buf.len() < need {
                    if h.kind == Kind::Data && h.len >= COPY_BELOW {
                        let mut own = pool.take(h.len);
                        if own.capacity() > 2 * h.len {
                            // A recycled buffer far larger than this payload would sit whole in
                            // the stream's inbox, whose bound (the window) counts bytes, not
                            // allocations: a small payload gets an allocation of its size.
                            own = Vec::with_capacity(h.len);
                        }
                        own.reserve_exact(h.len);
                        own.extend_from_slice(&buf[HEADER_LEN..]);
                        buf.clear();
                        large = Some((h, own));
                    } else {
                        buf.reserve(need - buf.len());
                    }
                    break;
                }
                buf.advance(HEADER_LEN);
                let payload = buf.split_to(h.len).freeze();
                self.on_frame(h, payload, false)?;
            }
            if let Some((h, own)) = &mut large {
                // The rest of the large payload, up to its end and no further.
                let rest = (h.len - own.len()) as u64;
                match (&mut self.rd).take(rest).read_buf(own).await {
                    Ok(0) => {
                        return Err(ConnError(format!(
                            "the peer closed the connection inside a frame ({} bytes of it read)",
                            own.len()
                        )));
                    }
                    Ok(_) => continue,
                    Err(e) => return Err(ConnError(format!("reading from the peer: {e}"))),
                }
            }
            if std::mem::take(&mut header_only) && buf.is_empty() {
                let mut head = (&mut self.rd).take(HEADER_LEN as u64);
                match head.read_buf(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(_) => continue,
                    Err(e) => return Err(ConnError(format!("reading from the peer: {e}"))),
                }
            }
            let room = if flowing {
                READ_BUFFER_BYTES
            } else {
                IDLE_READ_BUFFER_BYTES
            };
            if buf.is_empty() && !flowing && buf.capacity() > IDLE_READ_BUFFER_BYTES {
                // Done with a burst: give the large buffers back.
                buf = BytesMut::new();
                pool.release();
            }
            if buf.capacity() - buf.len() < room / 2 {
                buf.reserve(room);
            }
            let read = self.rd.read_buf(&mut buf).await;
            if let Ok(n) = &read {
                flowing = *n >= room / 2;
            }
            match read {
                Ok(0) => {
                    return if buf.is_empty() {
                        Ok(())
                    } else {
                        Err(ConnError(format!(
                            "the peer closed the connection inside a frame ({} bytes of it read)",
                            buf.len()
                        )))
                    };
                }
                Ok(_) => {}
                Err(e) => return Err(ConnError(format!("reading from the peer: {e}"))),
            }
        }
    }

    fn event(&self, e: Event) {
        if self.events.try_send(e).is_err() {
            tracing::debug!("tunnel event dropped: the owner is not listening");
        }
    }

    /// Handles one frame; `owned`: the payload is the only user of its allocation.
    fn on_frame(&mut self, h: frame::Header, payload: Bytes, owned: bool) -> Result<(), ConnError> {
        let shared = &self.shared;
        let need_stream = |id: u32| {
            if id == 0 {
                Err(ConnError(format!("{:?} frame on stream 0", h.kind)))
            } else {
                Ok(id)
            }
        };
        match h.kind {
            Kind::Data => {
                let id = need_stream(h.stream)?;
                let len = payload.len() as i64;
                {
                    let mut c = shared.conn_flow.lock().expect("connection flow");
                    if len > c.recv_granted {
                        return Err(ConnError(format!(
                            "the peer sent {len} bytes beyond the connection's window"
                        )));
                    }
                    c.recv_granted -= len;
                }
                let Some(stream) = shared.stream(id) else {
                    // Reset or finished here, bytes in flight: dropped, their connection
                    // window given back.
                    shared.release_connection(payload.len());
                    return Ok(());
                };
                let mut st = stream.st.lock().expect("stream");
                if st.error.is_some() || st.recv_fin {
                    drop(st);
                    shared.release_connection(payload.len());
                    return Ok(());
                }
                if len > st.recv_granted {
                    drop(st);
                    shared.release_connection(payload.len());
                    stream.reset(
                        ResetCode::FlowControl,
                        &format!("{len} bytes sent beyond the stream's window"),
                    );
                    return Ok(());
                }
                st.recv_granted -= len;
                if !payload.is_empty() {
                    // Bytes that share their allocation with other frames are copied out, so
                    // what waits in an inbox is bounded by the window, not by read buffers.
                    let bytes = if owned {
                        payload
                    } else {
                        Bytes::copy_from_slice(&payload)
                    };
                    st.inbox.push_back(bytes);
                }
                if h.flags & FLAG_FIN != 0 {
                    st.recv_fin = true;
                }
                if let Some(w) = st.rx_waker.take() {
                    w.wake();
                }
            }
            Kind::Credit if h.stream == 0 => {
                let n = frame::decode_u32(h.kind, &payload)?;
                let waiting = {
                    let mut c = shared.conn_flow.lock().expect("connection flow");
                    c.send_credit += i64::from(n);
                    std::mem::take(&mut c.waiting)
                };
                waiting.into_iter().for_each(Waker::wake);
            }
            Kind::Credit => {
                let id = h.stream;
                let n = frame::decode_u32(h.kind, &payload)?;
                if let Some(stream) = shared.stream(id) {
                    let mut st = stream.st.lock().expect("stream");
                    st.send_credit += i64::from(n);
                    if let Some(w) = st.tx_waker.take() {
                        w.wake();
                    }
                }
            }
            Kind::Reset => {
                let id = need_stream(h.stream)?;
                let (code, text) = frame::decode_reset(&payload)?;
                if let Some(stream) = shared.stream(id) {
                    let mut st = stream.st.lock().expect("stream");
                    let discarded = st.discard_inbox();
                    if let Some(o) = st.opened.take() {
                        let _ = o.send(Err(if code == ResetCode::Refused {
                            OpenError::NotTaken(text.clone())
                        } else {
                            OpenError::Lost(format!("the agent reset the stream: {text}"))
                        }));
                    }
                    if st.error.is_none() {
                        st.error = Some(AbortReason::PeerReset(format!("{code:?}: {text}")));
                    }
                    st.wake();
                    drop(st);
                    shared.release_connection(discarded);
                }
            }
            Kind::Window => {
                let (w, conn_window, max_streams) = frame::decode_window(&payload)?;
                shared
                    .peer_max_streams
                    .store(max_streams, Ordering::Relaxed);
                shared.change_windows(&shared.peer_window, w, |st, delta| {
                    st.send_credit += delta;
                    if let Some(w) = st.tx_waker.take() {
                        w.wake();
                    }
                });
                if !shared.peer_window_known.swap(true, Ordering::Relaxed) {
                    // The peer's connection window replaces the provisional default.
                    let waiting = {
                        let mut c = shared.conn_flow.lock().expect("connection flow");
                        c.send_credit += i64::from(conn_window) - 65_535;
                        std::mem::take(&mut c.waiting)
                    };
                    waiting.into_iter().for_each(Waker::wake);
                    shared.peer_known.notify_waiters();
                }
            }
            Kind::Open => self.on_open(h.stream, &payload)?,
            Kind::OpenOk | Kind::OpenErr => {
                if shared.role != Role::Opener {
                    return Err(ConnError(format!("{:?} sent to the agent", h.kind)));
                }
                let id = need_stream(h.stream)?;
                let result = if h.kind == Kind::OpenOk {
                    Ok(OpenOk::decode(&payload)?)
                } else {
                    let (kind, message) = frame::decode_open_err(&payload)?;
                    Err(OpenError::Dial { kind, message })
                };
                if let Some(stream) = shared.stream(id) {
                    let mut st = stream.st.lock().expect("stream");
                    if result.is_err() {
                        st.sent_fin = true;
                        st.recv_fin = true;
                    }
                    if let Some(o) = st.opened.take() {
                        let _ = o.send(result);
                    }
                }
            }
            Kind::Ping => {
                if payload.len() != 8 {
                    return Err(ConnError(format!("PING of {} bytes", payload.len())));
                }
                shared.queue(Kind::Pong, 0, 0, &payload);
            }
            Kind::Pong => {
                let mut slot = shared.pong.lock().expect("pong");
                if slot.as_ref().is_some_and(|(p, _)| p[..] == payload[..])
                    && let Some((_, tx)) = slot.take()
                {
                    let _ = tx.send(());
                }
            }
            Kind::Hello => self.event(Event::Hello(Hello::decode(&payload)?)),
            Kind::Auth => {
                if shared.role != Role::Acceptor {
                    return Err(ConnError("AUTH sent to the opening side".into()));
                }
                let credential = frame::decode_text(h.kind, &payload)?;
                *shared.peer_auth.lock().expect("auth") = Some(credential.into());
            }
            Kind::HelloOk => {
                let (cluster, agent) = frame::decode_pair(h.kind, &payload)?;
                self.event(Event::HelloOk { cluster, agent });
            }
            Kind::Refused => self.event(Event::Refused(frame::decode_text(h.kind, &payload)?)),
            Kind::Drain => {
                shared.draining.store(true, Ordering::Relaxed);
                self.event(Event::Drain);
            }
            Kind::GoAway => {
                let (last, reason) = frame::decode_goaway(&payload)?;
                shared.draining.store(true, Ordering::Relaxed);
                let not_taken: Vec<_> = {
                    let s = shared.streams.lock().expect("streams");
                    s.map
                        .iter()
                        .filter(|(id, _)| **id > last)
                        .map(|(_, st)| Arc::clone(st))
                        .collect()
                };
                for stream in not_taken {
                    let mut st = stream.st.lock().expect("stream");
                    if let Some(o) = st.opened.take() {
                        let _ = o.send(Err(OpenError::NotTaken(format!(
                            "the peer is closing this connection (GOAWAY: {reason}) and did not take the stream"
                        ))));
                    }
                    st.error = Some(AbortReason::PeerReset("not taken (GOAWAY)".into()));
                    st.wake();
                }
                self.event(Event::GoAway { last, reason });
            }
        }
        Ok(())
    }

    fn on_open(&mut self, id: u32, payload: &[u8]) -> Result<(), ConnError> {
        let shared = &self.shared;
        if shared.role != Role::Acceptor {
            return Err(ConnError("OPEN sent to the broker".into()));
        }
        let open = Open::decode(payload)?;
        let stream = {
            let mut s = shared.streams.lock().expect("streams");
            if id.is_multiple_of(2) || id <= s.last_seen {
                return Err(ConnError(format!(
                    "OPEN on stream {id}: stream ids must be odd and increasing (last {})",
                    s.last_seen
                )));
            }
            s.last_seen = id;
            let refuse = if s.going_away {
                Some("this tunnel is closing (GOAWAY)".to_owned())
            } else if s.map.len() >= shared.cfg.max_streams {
                Some(format!(
                    "the tunnel carries its limit of {} concurrent streams",
                    shared.cfg.max_streams
                ))
            } else {
                None
            };
            if let Some(reason) = refuse {
                drop(s);
                shared.queue(
                    Kind::Reset,
                    0,
                    id,
                    &frame::encode_reset(ResetCode::Refused, &reason),
                );
                return Ok(());
            }
            let stream = shared.new_stream(id);
            s.map.insert(id, Arc::clone(&stream));
            stream
        };
        let incoming = Incoming {
            open,
            auth: shared.peer_auth.lock().expect("auth").clone(),
            responder: Responder {
                stream: Arc::clone(&stream),
            },
            send: SendHalf {
                stream: Arc::clone(&stream),
            },
            recv: RecvHalf { stream },
        };
        match &self.on_open {
            Some(f) => f(incoming),
            None => drop(incoming),
        }
        Ok(())
    }
}

/// Writes queued control frames whenever woken; returns the write error that ended it.
async fn flusher(shared: &Shared) -> io::Error {
    loop {
        shared.flush_wake.notified().await;
        let mut io = shared.io.lock().await;
        shared.take_control(&mut io);
        if let Err(e) = flush(&mut io).await {
            return e;
        }
        drop(io);
        shared.wake_writable();
    }
}

#[cfg(test)]
mod tests;
