//! `tether-frame-cost`: what one small message costs in each layer of the tunnel's stack.
//!
//! Two threads of one process, each with its own single-threaded tokio runtime (as broker and
//! agent run by default on two CPUs), ping-pong a 64-byte message over one loopback TCP
//! connection, in four framings measured in alternating rounds:
//!
//! - `tcp`: the bytes on the socket (the floor of two tokio tasks and the kernel);
//! - `tls`: the same over rustls (Tether's provider), no framing: TLS's own per-record cost;
//! - `h2`: one HTTP/2 stream over that TLS connection, echoed by a stream task on the server as
//!   the agent's pump does (h2's connection task, stream state, flow control, the hand-off);
//! - `mux`: a minimal length-prefixed multiplexer over the same TLS connection with the same
//!   task shape as `h2` (a connection task reads frames and hands each to its stream's task
//!   through a bounded channel; replies go back through the connection's writer): what a
//!   lighter stream protocol than HTTP/2 would cost per message with nothing else changed.
//!
//! Per framing: the round trip's p50 and the CPU of both threads per round trip (schedstat of
//! the two threads), so the difference between rows is the per-message work of one layer.
//! docs/benchmarks.md (the thirteenth machine's section) has the method and the figures.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use clap::Parser;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use tether_e2e::benchkit::{TlsPair, percentile, thread_cpu_secs};

#[derive(Parser, Debug)]
#[command(about = "Per-message cost of TCP, TLS, HTTP/2 and a minimal multiplexer")]
struct Args {
    /// Round trips per framing and round.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Rounds (framings alternate within each round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// Size of the message sent each way.
const MESSAGE: usize = 64;
/// Bound of the per-stream and writer channels of the `mux` framing.
const MUX_CHANNEL: usize = 64;
/// Longest wait for one reply (or for the peer's end at the close) before the run fails.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// The error of a reply that did not come.
fn no_reply() -> String {
    format!("no reply within {REPLY_TIMEOUT:?}")
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Framing {
    Tcp,
    Tls,
    H2,
    Mux,
}

impl Framing {
    const ALL: [Framing; 4] = [Framing::Tcp, Framing::Tls, Framing::H2, Framing::Mux];
    fn name(self) -> &'static str {
        match self {
            Framing::Tcp => "tcp",
            Framing::Tls => "tls",
            Framing::H2 => "h2",
            Framing::Mux => "mux",
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let aead = tether_tls::install_default_crypto()?;
    println!(
        "tether-frame-cost: {MESSAGE} B round trips, {} per framing and round, {} rounds; TLS record encryption {aead}",
        args.messages, args.rounds
    );
    let tls = TlsPair::new("tether:broker:frame-cost", &[b"h2"])?;
    let mut results: Vec<(Framing, Vec<Duration>, f64)> =
        Framing::ALL.iter().map(|f| (*f, Vec::new(), 0.0)).collect();
    for round in 0..args.rounds {
        let mut order = Framing::ALL.to_vec();
        let n = order.len();
        order.rotate_left(round % n);
        for framing in order {
            eprintln!("  round {} {}", round + 1, framing.name());
            let (samples, cpu) = run_one(framing, &tls, args.messages)?;
            let r = results.iter_mut().find(|r| r.0 == framing).expect("listed");
            r.1.extend(samples);
            r.2 += cpu;
        }
    }
    println!(
        "| framing | round trip p50 | p99 | CPU per round trip (both ends) | vs the layer below |"
    );
    println!("|---|---:|---:|---:|---|");
    let per_rt = |cpu: f64| cpu / (args.messages * args.rounds) as f64 * 1e6;
    let mut below: Option<f64> = None;
    let tls_cpu = per_rt(
        results
            .iter()
            .find(|r| r.0 == Framing::Tls)
            .expect("listed")
            .2,
    );
    for (framing, samples, cpu) in &mut results {
        let framing = *framing;
        samples.sort();
        let p = |q: f64| percentile(samples, q);
        let c = per_rt(*cpu);
        // The multiplexer replaces HTTP/2, so it is compared with TLS like HTTP/2 is.
        let vs = match (framing, below) {
            (Framing::Mux, _) => format!("{:+.1} µs over tls", c - tls_cpu),
            (_, Some(b)) => format!("{:+.1} µs", c - b),
            _ => String::new(),
        };
        println!(
            "| {} | {} µs | {} µs | {:.1} µs | {vs} |",
            framing.name(),
            p(0.5).as_micros(),
            p(0.99).as_micros(),
            c
        );
        if framing != Framing::Mux {
            below = Some(c);
        }
    }
    let cpu = |f: Framing| per_rt(results.iter().find(|r| r.0 == f).expect("listed").2);
    println!(
        "HTTP/2 over TLS: {:+.1} µs CPU per round trip; the minimal multiplexer over TLS: {:+.1} µs ({:.0} % of HTTP/2's)",
        cpu(Framing::H2) - cpu(Framing::Tls),
        cpu(Framing::Mux) - cpu(Framing::Tls),
        (cpu(Framing::Mux) - cpu(Framing::Tls)) / (cpu(Framing::H2) - cpu(Framing::Tls)) * 100.0
    );
    Ok(())
}

/// Runs `messages` round trips in one framing; returns the samples and the CPU seconds of both
/// threads during them.
fn run_one(
    framing: Framing,
    tls: &TlsPair,
    messages: usize,
) -> anyhow::Result<(Vec<Duration>, f64)> {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&tls.server));
    let (tid_tx, tid_rx) = std::sync::mpsc::sync_channel(1);
    let server = std::thread::spawn(move || -> anyhow::Result<()> {
        tid_tx.send(thread_id()).ok();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let listener = TcpListener::from_std(std_listener)?;
            let (tcp, _) = within("accept", listener.accept()).await?;
            tcp.set_nodelay(true)?;
            match framing {
                Framing::Tcp => echo(tcp).await,
                Framing::Tls => echo(within("TLS accept", acceptor.accept(tcp)).await?).await,
                Framing::H2 => h2_server(within("TLS accept", acceptor.accept(tcp)).await?).await,
                Framing::Mux => mux_server(within("TLS accept", acceptor.accept(tcp)).await?).await,
            }
        })
    });
    let server_tid = tid_rx.recv().context("server thread")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client_tid = thread_id();
    let result = rt.block_on(async {
        let tcp = within("connect", TcpStream::connect(addr)).await?;
        tcp.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&tls.client));
        let cpu = || thread_cpu_secs(server_tid) + thread_cpu_secs(client_tid);
        match framing {
            Framing::Tcp => ping_pong(tcp, messages, cpu).await,
            Framing::Tls => {
                let tls = within("TLS connect", connector.connect(name, tcp)).await?;
                ping_pong(tls, messages, cpu).await
            }
            Framing::H2 => {
                let tls = within(
                    "TLS connect",
                    connector.with_alpn(vec![b"h2".to_vec()]).connect(name, tcp),
                )
                .await?;
                h2_client(tls, messages, cpu).await
            }
            Framing::Mux => {
                let tls = within("TLS connect", connector.connect(name, tcp)).await?;
                mux_client(tls, messages, cpu).await
            }
        }
    });
    drop(rt);
    match server.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => bail!("{} server: {e:#}", framing.name()),
        Err(_) => bail!("{} server panicked", framing.name()),
    }
    result
}

/// Sends a message, waits for its echo, `messages` times after a warm-up; the connection is
/// closed at the end (the server ends on EOF).
async fn ping_pong<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    messages: usize,
    cpu: impl Fn() -> f64,
) -> anyhow::Result<(Vec<Duration>, f64)> {
    let msg = [7u8; MESSAGE];
    let mut back = [0u8; MESSAGE];
    let mut meter = Meter::new(messages, &cpu);
    for _ in 0..meter.rounds() {
        let t = meter.begin();
        s.write_all(&msg).await?;
        s.flush().await?;
        tokio::time::timeout(REPLY_TIMEOUT, s.read_exact(&mut back))
            .await
            .with_context(no_reply)??;
        meter.end(t);
    }
    let (samples, used) = meter.finish();
    s.shutdown().await?;
    Ok((samples, used))
}

/// Longest wait for a connection step (connect, accept, TLS and HTTP/2 handshakes).
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// `step` within [`SETUP_TIMEOUT`]; its error, or the timeout, names the step.
async fn within<T, E: std::fmt::Display>(
    what: &str,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(SETUP_TIMEOUT, step).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => bail!("{what}: {e}"),
        Err(_) => bail!("{what}: no answer within {SETUP_TIMEOUT:?}"),
    }
}

/// Times each round trip after the warm-up and the CPU spent over the measured ones.
struct Meter<'a, C: Fn() -> f64> {
    cpu: &'a C,
    messages: usize,
    done: usize,
    samples: Vec<Duration>,
    cpu_at_start: f64,
}

impl<'a, C: Fn() -> f64> Meter<'a, C> {
    fn new(messages: usize, cpu: &'a C) -> Self {
        Self {
            cpu,
            messages,
            done: 0,
            samples: Vec::with_capacity(messages),
            cpu_at_start: 0.0,
        }
    }

    /// Round trips to run, warm-up included.
    fn rounds(&self) -> usize {
        self.messages + WARM_UP
    }

    /// A round trip starts (the first measured one also starts the CPU count).
    fn begin(&mut self) -> Instant {
        if self.done == WARM_UP {
            self.cpu_at_start = (self.cpu)();
        }
        Instant::now()
    }

    /// The round trip that began at `t` ended.
    fn end(&mut self, t: Instant) {
        if self.done >= WARM_UP {
            self.samples.push(t.elapsed());
        }
        self.done += 1;
    }

    /// The measured round trips and the CPU seconds they took.
    fn finish(self) -> (Vec<Duration>, f64) {
        let used = (self.cpu)() - self.cpu_at_start;
        (self.samples, used)
    }
}

/// Round trips before measuring.
const WARM_UP: usize = 500;

/// Echoes until EOF.
async fn echo<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        s.write_all(&buf[..n]).await?;
        s.flush().await?;
    }
}

async fn h2_server<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(s: S) -> anyhow::Result<()> {
    let mut conn = within("HTTP/2 handshake", h2::server::handshake(s)).await?;
    let Some(req) = tokio::time::timeout(SETUP_TIMEOUT, conn.accept())
        .await
        .with_context(|| format!("no HTTP/2 stream within {SETUP_TIMEOUT:?}"))?
    else {
        bail!("the client closed without opening a stream");
    };
    let (req, mut respond) = req?;
    // The stream task, as the agent's pump: take a chunk, give back its window, send it on.
    let stream = tokio::spawn(async move {
        let mut body = req.into_body();
        let mut send = respond.send_response(http::Response::new(()), false)?;
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            body.flow_control().release_capacity(chunk.len())?;
            send.send_data(chunk, false)?;
        }
        send.send_data(Bytes::new(), true)?;
        anyhow::Ok(())
    });
    // Drive the connection until the client goes away. The client ends by dropping its
    // runtime once it has its answers, so a write of ours still in flight (a window update,
    // the stream's end) may meet a closed socket: that is its going away, not a failure.
    while let Some(r) = conn.accept().await {
        match r {
            Ok(_) => {}
            Err(e) if client_gone(&e) => break,
            Err(e) => return Err(e.into()),
        }
    }
    match stream.await? {
        Err(e) if e.downcast_ref::<h2::Error>().is_some_and(client_gone) => Ok(()),
        r => r,
    }
}

/// An HTTP/2 error that only says the client's socket is gone (closed or reset).
fn client_gone(e: &h2::Error) -> bool {
    e.get_io().is_some_and(|io| {
        matches!(
            io.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        )
    })
}

async fn h2_client<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    s: S,
    messages: usize,
    cpu: impl Fn() -> f64,
) -> anyhow::Result<(Vec<Duration>, f64)> {
    let (mut client, conn) = within("HTTP/2 handshake", h2::client::handshake(s)).await?;
    let driver = tokio::spawn(conn);
    let req = http::Request::post("https://localhost/echo").body(())?;
    let (resp, mut send) = client.send_request(req, false)?;
    let mut body = within("HTTP/2 response", resp).await?.into_body();
    let msg = Bytes::from_static(&[7u8; MESSAGE]);
    let mut meter = Meter::new(messages, &cpu);
    for _ in 0..meter.rounds() {
        let t = meter.begin();
        send.send_data(msg.clone(), false)?;
        let mut got = 0;
        while got < MESSAGE {
            let chunk = tokio::time::timeout(REPLY_TIMEOUT, body.data())
                .await
                .with_context(no_reply)?
                .context("stream ended")??;
            got += chunk.len();
            body.flow_control().release_capacity(chunk.len())?;
        }
        meter.end(t);
    }
    let (samples, used) = meter.finish();
    send.send_data(Bytes::new(), true)?;
    let close = async {
        while body.data().await.is_some() {}
        // The connection ends once every handle to it is gone.
        drop((client, send, body));
        anyhow::Ok(driver.await??)
    };
    tokio::time::timeout(REPLY_TIMEOUT, close)
        .await
        .with_context(|| format!("HTTP/2 close not done within {REPLY_TIMEOUT:?}"))??;
    Ok((samples, used))
}

/// A `mux` frame: stream id (u32), payload length (u32), payload. Length 0 ends the stream.
fn mux_frame(stream: u32, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(8 + payload.len());
    b.put_u32(stream);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// Largest `mux` frame payload accepted (the messages are [`MESSAGE`] bytes).
const MUX_MAX_FRAME: usize = 64 << 10;

/// Reads one frame (`None` at EOF).
async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
) -> anyhow::Result<Option<(u32, Bytes)>> {
    loop {
        if buf.len() >= 8 {
            let len = u32::from_be_bytes(buf[4..8].try_into().expect("4 bytes")) as usize;
            if len > MUX_MAX_FRAME {
                bail!("mux frame of {len} bytes exceeds the limit of {MUX_MAX_FRAME}");
            }
            if buf.len() >= 8 + len {
                let stream = buf.get_u32();
                buf.advance(4);
                return Ok(Some((stream, buf.split_to(len).freeze())));
            }
        }
        if r.read_buf(buf).await? == 0 {
            return Ok(None);
        }
    }
}

/// The connection's writer task: frames from every stream, written as they come.
async fn mux_writer<W: AsyncWrite + Unpin>(
    mut w: W,
    mut frames: mpsc::Receiver<Bytes>,
) -> anyhow::Result<()> {
    while let Some(f) = frames.recv().await {
        w.write_all(&f).await?;
        w.flush().await?;
    }
    // close_notify, so the peer reads a clean end of the connection.
    w.shutdown().await?;
    Ok(())
}

async fn mux_server<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    s: S,
) -> anyhow::Result<()> {
    let (mut rd, wr) = tokio::io::split(s);
    let (out_tx, out_rx) = mpsc::channel::<Bytes>(MUX_CHANNEL);
    let writer = tokio::spawn(mux_writer(wr, out_rx));
    let mut streams: std::collections::HashMap<u32, mpsc::Sender<Bytes>> = Default::default();
    let mut tasks = Vec::new();
    let mut buf = BytesMut::with_capacity(64 << 10);
    while let Some((id, payload)) = read_frame(&mut rd, &mut buf).await? {
        let tx = match streams.get(&id) {
            Some(tx) => tx.clone(),
            None => {
                // The stream task, as the agent's pump: take a chunk, send it back.
                let (tx, mut rx) = mpsc::channel::<Bytes>(MUX_CHANNEL);
                let out = out_tx.clone();
                tasks.push(tokio::spawn(async move {
                    while let Some(chunk) = rx.recv().await {
                        let end = chunk.is_empty();
                        out.send(mux_frame(id, &chunk)).await?;
                        if end {
                            break;
                        }
                    }
                    anyhow::Ok(())
                }));
                streams.insert(id, tx.clone());
                tx
            }
        };
        let end = payload.is_empty();
        tx.send(payload).await?;
        if end {
            streams.remove(&id);
        }
    }
    drop((streams, out_tx));
    for t in tasks {
        t.await??;
    }
    writer.await??;
    Ok(())
}

async fn mux_client<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    s: S,
    messages: usize,
    cpu: impl Fn() -> f64,
) -> anyhow::Result<(Vec<Duration>, f64)> {
    const ID: u32 = 1;
    let (mut rd, wr) = tokio::io::split(s);
    let (out_tx, out_rx) = mpsc::channel::<Bytes>(MUX_CHANNEL);
    let writer = tokio::spawn(mux_writer(wr, out_rx));
    // The connection's reader task hands each frame to the stream (one stream here).
    let (in_tx, mut in_rx) = mpsc::channel::<Bytes>(MUX_CHANNEL);
    let reader = tokio::spawn(async move {
        let mut buf = BytesMut::with_capacity(64 << 10);
        while let Some((id, payload)) = read_frame(&mut rd, &mut buf).await? {
            if id == ID && in_tx.send(payload).await.is_err() {
                break;
            }
        }
        anyhow::Ok(())
    });
    let msg = [7u8; MESSAGE];
    let mut meter = Meter::new(messages, &cpu);
    for _ in 0..meter.rounds() {
        let t = meter.begin();
        out_tx.send(mux_frame(ID, &msg)).await?;
        let mut got = 0;
        while got < MESSAGE {
            let chunk = tokio::time::timeout(REPLY_TIMEOUT, in_rx.recv())
                .await
                .with_context(no_reply)?
                .context("stream ended")?;
            got += chunk.len();
        }
        meter.end(t);
    }
    let (samples, used) = meter.finish();
    out_tx.send(mux_frame(ID, &[])).await?;
    let close = async {
        // The server's end-of-stream frame, then close.
        while let Some(chunk) = in_rx.recv().await {
            if chunk.is_empty() {
                break;
            }
        }
        drop((out_tx, in_rx));
        anyhow::Ok(writer.await??)
    };
    let closed = tokio::time::timeout(REPLY_TIMEOUT, close)
        .await
        .with_context(|| format!("mux close not done within {REPLY_TIMEOUT:?}"));
    reader.abort();
    closed??;
    Ok((samples, used))
}

/// The calling thread's kernel id.
fn thread_id() -> i32 {
    nix::unistd::gettid().as_raw()
}
