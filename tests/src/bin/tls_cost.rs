//! `tether-tls-cost`: what rustls's buffered API costs the tunnel's bulk path, against its
//! unbuffered API, per GB on each side of one TLS connection.
//!
//! The tunnel's TLS runs on rustls's buffered API (through tokio-rustls): on the receiving side
//! a 64 KiB read-ahead (`tether_tunnel::readahead`) is copied into rustls's record buffer,
//! records are decrypted there, each record's plaintext is copied into rustls's plaintext queue
//! and from it into the multiplexer's buffer; on the sending side plaintext is copied into
//! records that rustls queues (up to the tunnel's send-buffer limit) for one `writev`. The
//! unbuffered API decrypts records in place in the buffer the socket was read into and
//! encrypts straight into the caller's buffer, which would remove two copies of every received
//! byte. Rewriting the tunnel's transport on it was the lever docs/benchmarks.md named for the
//! last part of "close to the floor"; this measures its ceiling first.
//!
//! Two threads of one process over one loopback TCP connection, blocking sockets, 256 KiB
//! writes (the tunnel's read chunk). For each side (receive, send) and each API, the measured
//! end's thread CPU (schedstat) over a timed transfer, in CPU-s per GB; the other end always
//! runs the buffered API. The APIs alternate within each round; the summary is the geometric
//! mean of the per-round ratios. The sides use what the tunnel uses: the receiving buffered end
//! reads the socket in [`READ_AHEAD`] pieces and reads plaintext into a
//! [`DEFAULT_READ_CHUNK`] buffer, the sending buffered end has rustls's send-buffer limit at
//! [`DEFAULT_TLS_SEND_BUFFER`]. docs/benchmarks.md (the twenty-seventh machine) has the figures.
#![forbid(unsafe_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rustls::client::{ClientConnection, ClientConnectionData, UnbufferedClientConnection};
use rustls::pki_types::ServerName;
use rustls::server::{ServerConnection, ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, UnbufferedStatus};

use tether_e2e::benchkit::{TlsPair, range_note, thread_cpu_secs};
use tether_tunnel::readahead::READ_AHEAD;
use tether_tunnel::settings::{DEFAULT_READ_CHUNK, DEFAULT_TLS_SEND_BUFFER};

tether_runtime::data_plane_allocator!();

#[derive(Parser, Debug)]
#[command(
    about = "CPU per GB of rustls's buffered API (as the tunnel uses it) against its unbuffered API"
)]
struct Args {
    /// Seconds of transfer per side, API and round.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Rounds (the APIs alternate within each round).
    #[arg(long, default_value_t = 6)]
    rounds: usize,
}

/// Bytes written per call: the tunnel's read chunk (one DATA frame's payload).
const CHUNK: usize = DEFAULT_READ_CHUNK;
/// Largest TLS record on the wire: 5 bytes of header and at most 16 KiB + 256 of ciphertext
/// (RFC 8446, 5.2).
const MAX_RECORD: usize = 5 + (16 << 10) + 256;
/// Longest a socket read or write may block before the run fails.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    Receive,
    Send,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Api {
    Buffered,
    Unbuffered,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Receive => "receive",
            Side::Send => "send",
        }
    }
}

impl Api {
    fn name(self) -> &'static str {
        match self {
            Api::Buffered => "buffered",
            Api::Unbuffered => "unbuffered",
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !(args.secs > 0.0 && args.rounds > 0) {
        bail!("--secs and --rounds must be above zero");
    }
    let aead = tether_tls::install_default_crypto()?;
    let dur = Duration::from_secs_f64(args.secs);
    println!(
        "tether-tls-cost: rustls buffered vs unbuffered API, {} KiB writes, {:.1} s × {} rounds per cell; TLS record encryption {aead}",
        CHUNK >> 10,
        args.secs,
        args.rounds
    );
    let tls = TlsPair::new("tether:broker:tls-cost", &[])?;
    // Per side: CPU-s/GB of each API per round.
    let mut figures: Vec<(Side, Vec<f64>, Vec<f64>)> = [Side::Receive, Side::Send]
        .into_iter()
        .map(|s| (s, Vec::new(), Vec::new()))
        .collect();
    for round in 0..args.rounds {
        let mut line = Vec::new();
        for (side, buffered, unbuffered) in &mut figures {
            let mut apis = [Api::Buffered, Api::Unbuffered];
            apis.rotate_left(round % 2);
            for api in apis {
                let (bytes, cpu) = measure(*side, api, &tls, dur)
                    .with_context(|| format!("{} {}", side.name(), api.name()))?;
                if bytes == 0 {
                    bail!("{} {}: no bytes moved", side.name(), api.name());
                }
                let gb = bytes as f64 / 1e9;
                let per_gb = cpu / gb;
                line.push(format!(
                    "{} {} {per_gb:.3} CPU-s/GB ({:.2} GB/s)",
                    side.name(),
                    api.name(),
                    gb / args.secs
                ));
                match api {
                    Api::Buffered => buffered.push(per_gb),
                    Api::Unbuffered => unbuffered.push(per_gb),
                }
            }
        }
        eprintln!("  round {}: {}", round + 1, line.join(", "));
    }
    println!("| side | buffered CPU-s/GB | unbuffered CPU-s/GB | unbuffered ÷ buffered [range] |");
    println!("|---|---:|---:|---|");
    for (side, buffered, unbuffered) in &figures {
        let ratios: Vec<f64> = buffered
            .iter()
            .zip(unbuffered)
            .map(|(b, u)| u / b)
            .collect();
        println!(
            "| {} | {:.3} | {:.3} | {:.2}×{} |",
            side.name(),
            geomean(buffered),
            geomean(unbuffered),
            geomean(&ratios),
            range_note(&ratios)
        );
    }
    Ok(())
}

fn geomean(v: &[f64]) -> f64 {
    (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp()
}

/// One timed transfer: the measured end (`side`, `api`) on this thread, the other end (buffered)
/// on a thread of its own. Returns the bytes the measured end moved and its CPU seconds.
fn measure(side: Side, api: Api, tls: &TlsPair, dur: Duration) -> anyhow::Result<(u64, f64)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    // The TLS server end accepts, the client end connects. The receiving end is the client (as
    // the agent is for downloads), the sending end the server.
    let (peer, sock) = match side {
        Side::Receive => {
            let (server, stop) = (tls.server.clone(), stop.clone());
            let peer = std::thread::spawn(move || -> anyhow::Result<()> {
                let (sock, _) = listener.accept()?;
                buffered_sender(prepare(sock)?, server, &stop)
            });
            (peer, prepare(TcpStream::connect(addr)?)?)
        }
        Side::Send => {
            let client = tls.client.clone();
            let peer = std::thread::spawn(move || -> anyhow::Result<()> {
                let sock = prepare(TcpStream::connect(addr)?)?;
                buffered_receiver_until_end(sock, client)
            });
            (peer, prepare(listener.accept()?.0)?)
        }
    };
    let result = match (side, api) {
        (Side::Receive, Api::Buffered) => buffered_receive(
            sock,
            ClientConnection::new(tls.client.clone(), localhost())?,
            dur,
        ),
        (Side::Receive, Api::Unbuffered) => run_unbuffered(
            UnbufferedClientConnection::new(tls.client.clone(), localhost())?,
            sock,
            dur,
            side,
        ),
        (Side::Send, Api::Buffered) => {
            buffered_send(sock, ServerConnection::new(tls.server.clone())?, dur)
        }
        (Side::Send, Api::Unbuffered) => run_unbuffered(
            UnbufferedServerConnection::new(tls.server.clone())?,
            sock,
            dur,
            side,
        ),
    };
    stop.store(true, Ordering::Relaxed);
    // The peer ends with an error or EOF once the measured end has shut its socket down; a
    // handshake failure shows on the measured end as well, so the peer's result is not needed.
    let _ = peer.join();
    result
}

fn localhost() -> ServerName<'static> {
    ServerName::try_from("localhost").expect("a valid name")
}

/// TCP_NODELAY (as every tunnel socket) and the I/O timeouts.
fn prepare(sock: TcpStream) -> anyhow::Result<TcpStream> {
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(IO_TIMEOUT))?;
    sock.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(sock)
}

fn thread_id() -> i32 {
    nix::unistd::gettid().as_raw()
}

/// The receive side's peer: writes [`CHUNK`]s until `stop` or until the receiver closes.
fn buffered_sender(
    sock: TcpStream,
    cfg: Arc<rustls::ServerConfig>,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let mut conn = ServerConnection::new(cfg)?;
    conn.set_buffer_limit(Some(DEFAULT_TLS_SEND_BUFFER));
    let mut tls = rustls::StreamOwned::new(conn, sock);
    let data = vec![0x5a; CHUNK];
    while !stop.load(Ordering::Relaxed) {
        tls.write_all(&data)?;
    }
    Ok(())
}

/// The send side's peer: reads until the sender closes.
fn buffered_receiver_until_end(
    sock: TcpStream,
    cfg: Arc<rustls::ClientConfig>,
) -> anyhow::Result<()> {
    let conn = ClientConnection::new(cfg, localhost())?;
    buffered_receive(sock, conn, Duration::MAX).map(|_| ())
}

/// Today's receiving path: a [`READ_AHEAD`] read of the socket, `read_tls` from it, plaintext
/// read into a [`CHUNK`] buffer.
fn buffered_receive(
    mut sock: TcpStream,
    mut conn: ClientConnection,
    dur: Duration,
) -> anyhow::Result<(u64, f64)> {
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).context("handshake")?;
    }
    let mut ahead = vec![0u8; READ_AHEAD];
    let (mut pos, mut filled) = (0, 0);
    let mut sink = vec![0u8; CHUNK];
    let mut moved = 0u64;
    let tid = thread_id();
    let (t0, c0) = (Instant::now(), thread_cpu_secs(tid));
    while t0.elapsed() < dur {
        match conn.reader().read(&mut sink) {
            Ok(0) => break,
            Ok(n) => {
                moved += n as u64;
                continue;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            // The sender closed without close_notify: the end of the transfer.
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        if pos == filled {
            filled = sock.read(&mut ahead)?;
            pos = 0;
            if filled == 0 {
                break;
            }
        }
        pos += conn.read_tls(&mut &ahead[pos..filled])?;
        conn.process_new_packets()?;
    }
    let cpu = thread_cpu_secs(tid) - c0;
    let _ = sock.shutdown(Shutdown::Both);
    Ok((moved, cpu))
}

/// Today's sending path: [`CHUNK`] writes through the buffered API with the tunnel's
/// send-buffer limit (each write's records leave in one `writev` or a few).
fn buffered_send(
    sock: TcpStream,
    mut conn: ServerConnection,
    dur: Duration,
) -> anyhow::Result<(u64, f64)> {
    conn.set_buffer_limit(Some(DEFAULT_TLS_SEND_BUFFER));
    let mut tls = rustls::StreamOwned::new(conn, sock);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock).context("handshake")?;
    }
    let data = vec![0x5a; CHUNK];
    let mut moved = 0u64;
    let tid = thread_id();
    let (t0, c0) = (Instant::now(), thread_cpu_secs(tid));
    while t0.elapsed() < dur {
        tls.write_all(&data)?;
        moved += CHUNK as u64;
    }
    let cpu = thread_cpu_secs(tid) - c0;
    let _ = tls.sock.shutdown(Shutdown::Both);
    Ok((moved, cpu))
}

/// The two unbuffered connection types, for one loop over both.
trait Unbuffered {
    type Data;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
}

/// Implements [`Unbuffered`] for a connection type with its `process_tls_records`.
macro_rules! unbuffered {
    ($conn:ty, $data:ty) => {
        impl Unbuffered for $conn {
            type Data = $data;
            fn process<'c, 'i>(
                &'c mut self,
                incoming: &'i mut [u8],
            ) -> UnbufferedStatus<'c, 'i, Self::Data> {
                self.process_tls_records(incoming)
            }
        }
    };
}

unbuffered!(UnbufferedClientConnection, ClientConnectionData);
unbuffered!(UnbufferedServerConnection, ServerConnectionData);

/// The unbuffered API: the socket read into `incoming` (a read-ahead's worth after whatever
/// partial record is left), records decrypted there, each payload copied once into a [`CHUNK`]
/// buffer (the copy the multiplexer would still make); or, sending, each [`CHUNK`] encrypted
/// straight into `outgoing` and written with one `write`.
fn run_unbuffered<C: Unbuffered>(
    mut conn: C,
    mut sock: TcpStream,
    dur: Duration,
    side: Side,
) -> anyhow::Result<(u64, f64)> {
    let mut incoming = vec![0u8; READ_AHEAD + MAX_RECORD];
    let mut used = 0;
    let mut outgoing = vec![0u8; CHUNK + CHUNK.div_ceil(16 << 10) * 64 + MAX_RECORD];
    let plain = vec![0x5a; CHUNK];
    let mut sink = vec![0u8; CHUNK];
    let mut at = 0;
    let mut moved = 0u64;
    let tid = thread_id();
    let mut clock: Option<(Instant, f64)> = None;
    loop {
        let status = conn.process(&mut incoming[..used]);
        let mut discard = status.discard;
        let mut read_more = false;
        match status.state.context("processing TLS records")? {
            ConnectionState::ReadTraffic(mut traffic) => {
                while let Some(record) = traffic.next_record() {
                    let record = record.context("decrypting a record")?;
                    discard += record.discard;
                    // A record (≤ 16 KiB) that does not fit starts the next chunk.
                    let payload = record.payload;
                    if at + payload.len() > CHUNK {
                        at = 0;
                    }
                    sink[at..at + payload.len()].copy_from_slice(payload);
                    at += payload.len();
                    moved += payload.len() as u64;
                }
            }
            ConnectionState::EncodeTlsData(mut state) => {
                let n = state
                    .encode(&mut outgoing)
                    .map_err(|e| anyhow::anyhow!("encoding a handshake message: {e}"))?;
                sock.write_all(&outgoing[..n])?;
            }
            ConnectionState::TransmitTlsData(state) => state.done(),
            ConnectionState::BlockedHandshake => read_more = true,
            ConnectionState::WriteTraffic(mut traffic) => {
                let (t0, _) = *clock.get_or_insert_with(|| (Instant::now(), thread_cpu_secs(tid)));
                if t0.elapsed() >= dur {
                    break;
                }
                match side {
                    Side::Send => {
                        let n = traffic
                            .encrypt(&plain, &mut outgoing)
                            .map_err(|e| anyhow::anyhow!("encrypting: {e}"))?;
                        sock.write_all(&outgoing[..n])?;
                        moved += CHUNK as u64;
                    }
                    Side::Receive => read_more = true,
                }
            }
            ConnectionState::PeerClosed | ConnectionState::Closed => break,
            other => bail!("unexpected TLS state {other:?}"),
        }
        if discard > 0 {
            incoming.copy_within(discard..used, 0);
            used -= discard;
        }
        if read_more {
            let n = sock.read(&mut incoming[used..])?;
            if n == 0 {
                break;
            }
            used += n;
        }
    }
    let cpu = clock.map_or(0.0, |(_, c0)| thread_cpu_secs(tid) - c0);
    let _ = sock.shutdown(Shutdown::Both);
    Ok((moved, cpu))
}
