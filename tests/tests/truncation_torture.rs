//! Truncation torture: thousands of randomised transfers through every front end of the broker
//! (plain CONNECT, TLS CONNECT, native gRPC Dial via `tether-client` on the TLS port and on the
//! plain port, konnectivity) at once,
//! with half-closes in both directions, client aborts, target aborts (RST via `SO_LINGER 0`) and
//! process kills, checking every byte count and every end state against what each side was told.
//!
//! Layout:
//! - a [`Plan`] per transfer: upload and download payloads (sizes log-uniform from 0 B to
//!   [`MAX_BYTES`]), what the client does ([`ClientMode`]) and what the target does
//!   ([`TargetMode`]); drawn from a seeded RNG whose seed is printed (replay with
//!   `TETHER_TORTURE_SEED=<seed>`);
//! - the target ([`target`]): an in-process listener on 127.0.0.1:0; each connection starts with
//!   the plan id (8 bytes), the target then plays its part and reports what it received and how
//!   its read side ended ([`Saw`]);
//! - the clients ([`run_stream`] for the byte-stream front ends, [`run_konnectivity`]) report
//!   the same for their side;
//! - [`judge`] compares both reports with the plan. A *silent truncation* is a side that was
//!   told "clean end" (EOF/FIN, close_notify, OK status, CLOSE_RSP without error) with bytes
//!   missing or damaged; a *mismatched end state* is an abort not reported as an error to the
//!   other side, or a transfer without aborts that did not end cleanly on both sides.
//!
//! Knobs: `TETHER_TORTURE_TRANSFERS` (default [`DEFAULT_TRANSFERS`], about 20–40 s on 2 loaded
//! cores in a debug build), `TETHER_TORTURE_SEED`, `TETHER_TORTURE_MAX_BYTES`.
//!
//! Run: `cargo build -p tunnel-broker -p tunnel-agent --bins &&
//! cargo test -p tether-e2e --test truncation_torture -- --nocapture`.

mod grpc_support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::SinkExt as _;
use grpc_support::{channel, close_req, data, dial_req, next_packet, streaming_request};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tether_e2e::{OPS_TOKEN, Setup, qualified};
use tether_proto::konnectivity as k;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::oneshot;

/// Transfers of one run unless `TETHER_TORTURE_TRANSFERS` says otherwise.
const DEFAULT_TRANSFERS: usize = 2000;
/// Largest payload in one direction unless `TETHER_TORTURE_MAX_BYTES` says otherwise.
const MAX_BYTES: usize = 1 << 20;
/// Concurrent transfers per front end.
const WORKERS: usize = 3;
/// Deadline of one transfer (either side), and of the target's report after the client ended.
const TRANSFER_DEADLINE: Duration = Duration::from_secs(60);
/// konnectivity DATA packets carry at most this much.
const KONN_CHUNK: usize = 256 << 10;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Position-dependent checksum (a lost, duplicated or reordered byte changes it).
fn checksum(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ b.len() as u64;
    for &x in b {
        h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Front {
    Connect,
    TlsConnect,
    Native,
    /// The native Dial over the plain client port (h2c).
    NativePlain,
    Konnectivity,
}

const FRONTS: [Front; 5] = [
    Front::Connect,
    Front::TlsConnect,
    Front::Native,
    Front::NativePlain,
    Front::Konnectivity,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClientMode {
    /// Write everything, half-close (konnectivity: read to the target's CLOSE_RSP, then end
    /// the request stream), read to the end.
    Close,
    /// konnectivity only: write everything, CLOSE_REQ, wait for CLOSE_RSP (the download is
    /// discarded by the broker, as `net.Conn.Close` does).
    CloseReq,
    /// Write `after` bytes (fewer than the upload), then abort: RST (zero linger), a dropped
    /// `DialStream` without `shutdown()`, konnectivity DIAL_CLS on the open connection.
    Abort { after: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TargetMode {
    /// Write the download and half-close while reading the upload to its end.
    Normal,
    /// Write the whole download and half-close before reading anything.
    CloseFirst,
    /// Write `after` bytes of the download (fewer than all of it) while reading, then RST.
    Abort { after: usize },
    /// Write `after` bytes of the download, then read on and never close (the kill rounds).
    Hold { after: usize },
}

struct Plan {
    id: u64,
    front: Front,
    up: Bytes,
    down: Bytes,
    client: ClientMode,
    target: TargetMode,
}

/// How a read side ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    /// Clean end: EOF after FIN / close_notify / OK status / CLOSE_RSP without error.
    Clean,
    /// An error was reported.
    Error(String),
    /// This side aborted itself before its read side ended.
    SelfAborted,
    /// Nothing within the deadline.
    Stuck,
}

/// What one side received.
#[derive(Clone, Debug)]
struct Saw {
    len: usize,
    sum: u64,
    end: End,
    /// The broker discards the download by design (konnectivity CLOSE_REQ): bytes not checked.
    discarded: bool,
}

impl Saw {
    fn of(got: &[u8], end: End) -> Self {
        Self {
            len: got.len(),
            sum: checksum(got),
            end,
            discarded: false,
        }
    }
}

/// The target's view of the plans in flight: plan id → (download, mode, header ack, report).
type Registry = Arc<Mutex<HashMap<u64, TargetSlot>>>;

struct TargetSlot {
    down: Bytes,
    mode: TargetMode,
    header: oneshot::Sender<()>,
    report: oneshot::Sender<Saw>,
}

/// Connections that ended before their 8-byte plan id: with a FIN (a truncation, since every
/// client sends the id first) or with an error.
#[derive(Default)]
struct Anonymous {
    fin: AtomicU64,
    error: AtomicU64,
}

/// Reads `r` to its end into `got`; the end state.
async fn read_all<R: AsyncRead + Unpin>(r: &mut R, got: &mut Vec<u8>) -> End {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match r.read(&mut buf).await {
            Ok(0) => return End::Clean,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return End::Error(e.to_string()),
        }
    }
}

/// Writes `b` then half-closes.
async fn write_close<W: AsyncWrite + Unpin>(w: &mut W, b: &[u8]) -> std::io::Result<()> {
    w.write_all(b).await?;
    w.shutdown().await
}

/// The torture target on 127.0.0.1:0.
async fn target(reg: Registry, anon: Arc<Anonymous>) -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (reg, anon) = (Arc::clone(&reg), Arc::clone(&anon));
            tokio::spawn(async move { target_conn(s, reg, anon).await });
        }
    });
    Ok(addr)
}

async fn target_conn(mut s: tokio::net::TcpStream, reg: Registry, anon: Arc<Anonymous>) {
    let mut id = [0u8; 8];
    if let Err(e) = s.read_exact(&mut id).await {
        let counter = match e.kind() {
            std::io::ErrorKind::UnexpectedEof => &anon.fin,
            _ => &anon.error,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let slot = reg
        .lock()
        .expect("registry")
        .remove(&u64::from_le_bytes(id));
    let Some(slot) = slot else {
        anon.error.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let _ = slot.header.send(());
    let mut got = Vec::new();
    let work = async {
        let (mut r, mut w) = s.split();
        match slot.mode {
            TargetMode::Normal => {
                let (end, _) =
                    tokio::join!(read_all(&mut r, &mut got), write_close(&mut w, &slot.down));
                end
            }
            TargetMode::CloseFirst => {
                let _ = write_close(&mut w, &slot.down).await;
                read_all(&mut r, &mut got).await
            }
            TargetMode::Hold { after } => {
                let _ = w.write_all(&slot.down[..after]).await;
                read_all(&mut r, &mut got).await
            }
            TargetMode::Abort { after } => {
                let mut read_end = None;
                let write = w.write_all(&slot.down[..after]);
                tokio::pin!(write);
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    tokio::select! {
                        _ = &mut write => break,
                        r = r.read(&mut buf), if read_end.is_none() => match r {
                            Ok(0) => read_end = Some(End::Clean),
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                            Err(e) => read_end = Some(End::Error(e.to_string())),
                        },
                    }
                }
                read_end.unwrap_or(End::SelfAborted)
            }
        }
    };
    let end = tokio::time::timeout(TRANSFER_DEADLINE, work)
        .await
        .unwrap_or(End::Stuck);
    if matches!(slot.mode, TargetMode::Abort { .. }) {
        let _ = s.set_zero_linger();
    }
    drop(s);
    let _ = slot.report.send(Saw::of(&got, end));
}

/// A byte stream that can be aborted (the peer sees a reset).
trait Conn: AsyncRead + AsyncWrite + Send + Unpin {
    fn abort(self: Box<Self>);
}

/// A client connection through one of the byte-stream front ends.
type BoxConn = Box<dyn Conn>;

impl Conn for tokio::net::TcpStream {
    fn abort(self: Box<Self>) {
        let _ = self.set_zero_linger();
    }
}

impl Conn for tether_e2e::ClientTls {
    fn abort(self: Box<Self>) {
        let _ = self.get_ref().0.set_zero_linger();
    }
}

impl Conn for tether_client::DialStream {
    /// Dropped without `shutdown()`: the client sends `abort`.
    fn abort(self: Box<Self>) {}
}

/// Drains `r` until it ends, then waits forever (a branch of a `select!`).
async fn drain_forever<R: AsyncRead + Unpin>(r: &mut R) {
    let mut buf = vec![0u8; 64 << 10];
    while matches!(r.read(&mut buf).await, Ok(n) if n > 0) {}
    std::future::pending::<()>().await;
}

/// One transfer over a byte-stream front end.
async fn run_stream(s: BoxConn, plan: &Plan, header: oneshot::Receiver<()>) -> Saw {
    let (mut r, mut w) = tokio::io::split(s);
    let id = plan.id.to_le_bytes();
    match plan.client {
        ClientMode::Close | ClientMode::CloseReq => {
            let writer = async {
                w.write_all(&id).await?;
                write_close(&mut w, &plan.up).await
            };
            let mut got = Vec::new();
            let (written, end) = tokio::join!(writer, read_all(&mut r, &mut got));
            // A reset reported to the writer is the client's news of the abort: the kernel
            // reports a socket's error once, so the read that follows returns 0 as if a FIN
            // had come. A client that watches both halves (as this one does) is not misled.
            let end = match (written, end) {
                (Err(e), End::Clean) => End::Error(format!("write: {e}")),
                (_, end) => end,
            };
            Saw::of(&got, end)
        }
        ClientMode::Abort { after } => {
            let writer = async {
                w.write_all(&id).await?;
                w.flush().await?;
                // Abort mid-transfer: after the target has the plan id.
                let _ = tokio::time::timeout(TRANSFER_DEADLINE, header).await;
                w.write_all(&plan.up[..after]).await?;
                w.flush().await
            };
            tokio::select! {
                _ = writer => {}
                _ = drain_forever(&mut r) => {}
            }
            r.unsplit(w).abort();
            Saw::of(&[], End::SelfAborted)
        }
    }
}

/// konnectivity DATA packets for `b` (none when empty: the protocol never sends empty DATA).
fn konn_chunks(connect_id: i64, b: &Bytes) -> Vec<k::Packet> {
    (0..b.len())
        .step_by(KONN_CHUNK)
        .map(|o| data(connect_id, b.slice(o..(o + KONN_CHUNK).min(b.len()))))
        .collect()
}

/// Opens a konnectivity connection for plan `id` and sends the plan id as the first DATA.
async fn konn_open(
    mut client: k::proxy_service_client::ProxyServiceClient<tonic::transport::Channel>,
    address: String,
    id: u64,
) -> anyhow::Result<(KonnKeep, tonic::Streaming<k::Packet>, i64)> {
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(address, id as i64)).await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let connect_id = match next_packet(&mut inbound).await?.payload {
        Some(k::packet::Payload::DialResponse(d)) if d.error.is_empty() => d.connect_id,
        other => anyhow::bail!("expected a successful DIAL_RSP, got {other:?}"),
    };
    if let Err(e) = tx
        .send(data(connect_id, Bytes::copy_from_slice(&id.to_le_bytes())))
        .await
    {
        // The request stream is gone: say what the broker sent instead.
        let next = tokio::time::timeout(Duration::from_secs(5), inbound.message()).await;
        anyhow::bail!("sending the plan id after DIAL_RSP: {e}; the broker sent then: {next:?}");
    }
    Ok((tx, inbound, connect_id))
}

/// One transfer over konnectivity. Returns what the client saw and what must stay alive until
/// the target reported (an aborting client holds its request stream open, so that the broker
/// sees a cancellation and not a clean end of the request stream).
async fn run_konnectivity(
    client: k::proxy_service_client::ProxyServiceClient<tonic::transport::Channel>,
    address: String,
    plan: &Plan,
    header: oneshot::Receiver<()>,
) -> anyhow::Result<(Saw, Option<KonnKeep>)> {
    let (mut tx, mut inbound, connect_id) = konn_open(client, address, plan.id).await?;
    if let ClientMode::Abort { after } = plan.client {
        let _ = tokio::time::timeout(TRANSFER_DEADLINE, header).await;
        for p in konn_chunks(connect_id, &plan.up.slice(..after)) {
            tx.send(p).await?;
        }
        // The protocol's abort: DIAL_CLS on an open connection (the target is reset). A gRPC
        // cancel is not used: upstream's client cancels its RPC after every CLOSE_RSP, so the
        // broker treats a cancel after the target closed as a close (docs/tunnel-protocol.md).
        tx.send(grpc_support::packet(
            k::PacketType::DialCls,
            k::packet::Payload::CloseDial(k::CloseDial {
                random: plan.id as i64,
            }),
        ))
        .await?;
        drop(inbound);
        return Ok((Saw::of(&[], End::SelfAborted), Some(tx)));
    }
    let close_req_mode = plan.client == ClientMode::CloseReq;
    let writer = async {
        for p in konn_chunks(connect_id, &plan.up) {
            tx.send(p).await?;
        }
        if close_req_mode {
            tx.send(close_req(connect_id)).await?;
        }
        anyhow::Ok(())
    };
    let mut got = Vec::new();
    let reader = async {
        loop {
            let p = match inbound.message().await {
                Ok(Some(p)) => p,
                Ok(None) => return End::Error("RPC ended without CLOSE_RSP".into()),
                Err(s) => return End::Error(format!("status {s}")),
            };
            match p.payload {
                Some(k::packet::Payload::Data(d)) if d.connect_id == connect_id => {
                    if d.data.is_empty() {
                        return End::Error("empty DATA".into());
                    }
                    got.extend_from_slice(&d.data)
                }
                Some(k::packet::Payload::CloseResponse(c)) if c.error.is_empty() => {
                    return End::Clean;
                }
                Some(k::packet::Payload::CloseResponse(c)) => {
                    return End::Error(format!("CLOSE_RSP {}", c.error));
                }
                other => return End::Error(format!("unexpected packet {other:?}")),
            }
        }
    };
    let (_, mut end) = tokio::join!(writer, reader);
    drop(tx); // the client ends its request stream: FIN to the target
    if end == End::Clean {
        // After a clean CLOSE_RSP the RPC must end with OK and nothing else.
        match inbound.message().await {
            Ok(None) => {}
            Ok(Some(p)) => end = End::Error(format!("packet after CLOSE_RSP: {p:?}")),
            Err(s) => end = End::Error(format!("status after clean CLOSE_RSP: {s}")),
        }
    }
    let mut saw = Saw::of(&got, end);
    saw.discarded = close_req_mode;
    Ok((saw, None))
}

/// The request side of an aborted konnectivity RPC, held until the target reported.
type KonnKeep = futures::channel::mpsc::Sender<k::Packet>;

/// Log-uniform in 0 ..= max.
fn log_uniform(rng: &mut StdRng, max: usize) -> usize {
    let x: f64 = rng.random_range(0.0..=((max + 1) as f64).ln());
    ((x.exp() - 1.0).round() as usize).min(max)
}

fn plans(rng: &mut StdRng, n: usize, max: usize, pool: &Bytes) -> Vec<Plan> {
    (0..n)
        .map(|i| {
            let front = FRONTS[i % FRONTS.len()];
            let payload = |rng: &mut StdRng| {
                let len = log_uniform(rng, max);
                let off = rng.random_range(0..4096);
                pool.slice(off..off + len)
            };
            let up = payload(rng);
            let down = payload(rng);
            let client = match rng.random_range(0..100) {
                0..15 if !up.is_empty() => ClientMode::Abort {
                    after: rng.random_range(0..up.len()),
                },
                15..50 if front == Front::Konnectivity => ClientMode::CloseReq,
                _ => ClientMode::Close,
            };
            let target = match rng.random_range(0..100) {
                0..15 => TargetMode::Abort {
                    after: rng.random_range(0..down.len().max(1)),
                },
                15..40 => TargetMode::CloseFirst,
                _ => TargetMode::Normal,
            };
            Plan {
                id: i as u64 + 1,
                front,
                up,
                down,
                client,
                target,
            }
        })
        .collect()
}

/// Everything the clients need to reach the target through each front end.
struct Fronts {
    cluster: String,
    target: SocketAddr,
    plain: SocketAddr,
    tls: SocketAddr,
    tls_cfg: rustls::ClientConfig,
    dialer: tether_client::Dialer,
    dialer_plain: tether_client::Dialer,
    konn: k::proxy_service_client::ProxyServiceClient<tonic::transport::Channel>,
}

impl Fronts {
    async fn new(setup: &Setup, target: SocketAddr) -> anyhow::Result<Self> {
        Ok(Self {
            cluster: setup.agent.cluster.clone(),
            target,
            plain: setup.broker.client_addr,
            tls: setup.broker.client_tls_addr,
            tls_cfg: tether_e2e::client_tls_config(&setup.hub.pki.ca_path(), &[b"http/1.1"], None)?,
            dialer: setup.ops_dialer().await?,
            dialer_plain: setup.ops_dialer_plain().await?,
            konn: k::proxy_service_client::ProxyServiceClient::new(channel(setup).await?),
        })
    }

    /// Opens a connection to the target through a byte-stream front end.
    async fn open(&self, front: Front) -> anyhow::Result<BoxConn> {
        let authority = qualified(&self.cluster, self.target);
        Ok(match front {
            Front::Connect => Box::new(tether_e2e::connect_ok(self.plain, &authority).await?),
            Front::TlsConnect => Box::new(
                tether_e2e::connect_tls(
                    self.tls,
                    self.tls_cfg.clone(),
                    &authority,
                    Some(OPS_TOKEN),
                )
                .await?
                .map_err(|(code, body)| anyhow::anyhow!("CONNECT answered {code}: {body}"))?,
            ),
            Front::Native | Front::NativePlain => Box::new(
                if front == Front::Native {
                    &self.dialer
                } else {
                    &self.dialer_plain
                }
                .dial(
                    &self.cluster,
                    &self.target.ip().to_string(),
                    self.target.port(),
                )
                .await?,
            ),
            Front::Konnectivity => anyhow::bail!("konnectivity is not a byte stream"),
        })
    }

    /// Opens the client side of `plan` and runs it; the client's report and whatever must
    /// stay alive until the target reported.
    async fn run(
        &self,
        plan: &Plan,
        header: oneshot::Receiver<()>,
    ) -> anyhow::Result<(Saw, Option<KonnKeep>)> {
        if plan.front == Front::Konnectivity {
            let authority = qualified(&self.cluster, self.target);
            return run_konnectivity(self.konn.clone(), authority, plan, header).await;
        }
        let s = self.open(plan.front).await?;
        Ok((run_stream(s, plan, header).await, None))
    }
}

/// The verdict on one transfer.
#[derive(Debug, Default)]
struct Verdict {
    /// A side told "clean end" got fewer, more or other bytes.
    truncations: Vec<String>,
    /// An end state that contradicts the plan (an abort not reported, a spurious error).
    mismatches: Vec<String>,
    /// How long each transfer took, by front end.
    took: Vec<(Front, Duration)>,
}

fn judge(plan: &Plan, client: &Saw, target: &Saw, v: &mut Verdict) {
    let tag = format!(
        "plan {} {:?} client {:?} target {:?} up {} down {}",
        plan.id,
        plan.front,
        plan.client,
        plan.target,
        plan.up.len(),
        plan.down.len()
    );
    let client_aborts = matches!(plan.client, ClientMode::Abort { .. });
    let target_aborts = matches!(plan.target, TargetMode::Abort { .. });
    // Silent truncation: a clean end with the wrong bytes.
    if client.end == End::Clean
        && !client.discarded
        && (client.len, client.sum) != (plan.down.len(), checksum(&plan.down))
    {
        v.truncations.push(format!(
            "{tag}: the client saw a clean end after {} of {} download bytes (or damaged)",
            client.len,
            plan.down.len()
        ));
    }
    // End states.
    if target_aborts && client.end == End::Clean && !client_aborts {
        v.mismatches.push(format!(
            "{tag}: the target reset, the client was told clean end"
        ));
    }
    if target.end == End::Clean && (target.len, target.sum) != (plan.up.len(), checksum(&plan.up)) {
        v.truncations.push(format!(
            "{tag}: the target saw a clean end after {} of {} upload bytes (or damaged)",
            target.len,
            plan.up.len()
        ));
    }
    if !client_aborts && !target_aborts && (client.end != End::Clean || target.end != End::Clean) {
        v.mismatches.push(format!(
            "{tag}: no abort, yet client end {:?} ({} bytes), target end {:?} ({} bytes)",
            client.end, client.len, target.end, target.len
        ));
    }
    if client_aborts && !target_aborts && !matches!(target.end, End::Error(_)) {
        v.mismatches.push(format!(
            "{tag}: the client aborted, the target's end is {:?}",
            target.end
        ));
    }
    if target_aborts && !client_aborts && !matches!(client.end, End::Error(_)) {
        v.mismatches.push(format!(
            "{tag}: the target reset, the client's end is {:?}",
            client.end
        ));
    }
    for (side, s) in [("client", client), ("target", target)] {
        if s.end == End::Stuck {
            v.mismatches
                .push(format!("{tag}: the {side} was stuck past the deadline"));
        }
    }
}

/// Runs one plan end to end: registers it with the target, runs the client, waits for the
/// target's report, judges.
async fn transfer(fronts: &Fronts, reg: &Registry, plan: &Plan, v: &mut Verdict) {
    let (header_tx, header_rx) = oneshot::channel();
    let (report_tx, report_rx) = oneshot::channel();
    reg.lock().expect("registry").insert(
        plan.id,
        TargetSlot {
            down: plan.down.clone(),
            mode: plan.target,
            header: header_tx,
            report: report_tx,
        },
    );
    let started = Instant::now();
    let client = tokio::time::timeout(TRANSFER_DEADLINE, fronts.run(plan, header_rx)).await;
    let (client, keep) = match client {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            v.mismatches.push(format!(
                "plan {} {:?}: could not open: {e:#}",
                plan.id, plan.front
            ));
            reg.lock().expect("registry").remove(&plan.id);
            return;
        }
        Err(_) => (Saw::of(&[], End::Stuck), None),
    };
    let target = tokio::time::timeout(TRANSFER_DEADLINE, report_rx)
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_else(|| Saw::of(&[], End::Stuck));
    drop(keep);
    let took = started.elapsed();
    if took > Duration::from_secs(2) {
        println!(
            "  slow: plan {} {:?} client {:?} target {:?} up {} down {} took {took:.1?}; client {:?}, target {:?}",
            plan.id,
            plan.front,
            plan.client,
            plan.target,
            plan.up.len(),
            plan.down.len(),
            client.end,
            target.end
        );
    }
    v.took.push((plan.front, took));
    judge(plan, &client, &target, v);
}

#[derive(Default)]
struct Tally {
    transfers: usize,
    bytes: usize,
    per_front: HashMap<Front, usize>,
    client_aborts: usize,
    target_aborts: usize,
    close_first: usize,
}

/// Thousands of random transfers through all four front ends at once: zero silent
/// truncations, zero mismatched end states.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_transfers_never_truncate_silently() -> anyhow::Result<()> {
    let n = env_usize("TETHER_TORTURE_TRANSFERS", DEFAULT_TRANSFERS);
    let max = env_usize("TETHER_TORTURE_MAX_BYTES", MAX_BYTES);
    let seed = std::env::var("TETHER_TORTURE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!(
        "truncation torture: seed {seed} (replay with TETHER_TORTURE_SEED={seed}), {n} transfers, sizes 0..={max} B"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pool = vec![0u8; max + 4096];
    rng.fill(&mut pool[..]);
    let plans = Arc::new(plans(&mut rng, n, max, &Bytes::from(pool)));

    let setup = Setup::start("c1", "", "").await?;
    let reg: Registry = Arc::default();
    let anon = Arc::new(Anonymous::default());
    let target_addr = target(Arc::clone(&reg), Arc::clone(&anon)).await?;
    let fronts = Arc::new(Fronts::new(&setup, target_addr).await?);

    let mut tally = Tally::default();
    for p in plans.iter() {
        tally.transfers += 1;
        tally.bytes += p.up.len() + p.down.len();
        *tally.per_front.entry(p.front).or_default() += 1;
        tally.client_aborts += usize::from(matches!(p.client, ClientMode::Abort { .. }));
        tally.target_aborts += usize::from(matches!(p.target, TargetMode::Abort { .. }));
        tally.close_first += usize::from(p.target == TargetMode::CloseFirst);
    }
    let started = Instant::now();
    let mut workers = Vec::new();
    // WORKERS workers per front end, each taking every (4 × WORKERS)-th plan.
    let stride = FRONTS.len() * WORKERS;
    for w in 0..stride {
        let (plans, fronts, reg) = (Arc::clone(&plans), Arc::clone(&fronts), Arc::clone(&reg));
        workers.push(tokio::spawn(async move {
            let mut v = Verdict::default();
            for p in plans.iter().skip(w).step_by(stride) {
                transfer(&fronts, &reg, p, &mut v).await;
            }
            v
        }));
    }
    let mut verdict = Verdict::default();
    for w in workers {
        let v = w.await?;
        verdict.truncations.extend(v.truncations);
        verdict.mismatches.extend(v.mismatches);
        verdict.took.extend(v.took);
    }
    let took = started.elapsed();
    let anon_fin = anon.fin.load(Ordering::Relaxed);
    println!(
        "truncation torture: {} transfers ({:?}), {:.1} MiB, {} client aborts, {} target resets, {} target-closes-first, in {took:.2?}: {} silent truncations, {} mismatched end states, {} connections ended before their plan id ({anon_fin} with a FIN)",
        tally.transfers,
        tally.per_front,
        tally.bytes as f64 / f64::from(1 << 20),
        tally.client_aborts,
        tally.target_aborts,
        tally.close_first,
        verdict.truncations.len(),
        verdict.mismatches.len(),
        anon_fin + anon.error.load(Ordering::Relaxed),
    );
    for front in FRONTS {
        let mut t: Vec<Duration> = verdict
            .took
            .iter()
            .filter(|(f, _)| *f == front)
            .map(|(_, d)| *d)
            .collect();
        t.sort();
        if let (Some(max), false) = (t.last(), t.is_empty()) {
            println!(
                "  {front:?}: median {:.1?}, p99 {:.1?}, max {max:.1?} per transfer",
                t[t.len() / 2],
                t[(t.len() * 99 / 100).min(t.len() - 1)]
            );
        }
    }
    let failed = !verdict.truncations.is_empty() || !verdict.mismatches.is_empty() || anon_fin > 0;
    if failed {
        // The process logs first, so the verdict is the end of the output (CI shows the end).
        setup.hub.print_log_tails();
    }
    // Stopped before the assertions: a panic with them alive would print the logs again.
    drop(fronts);
    drop(setup);
    let first: Vec<&String> = verdict
        .truncations
        .iter()
        .chain(&verdict.mismatches)
        .take(10)
        .collect();
    assert!(
        verdict.truncations.is_empty(),
        "silent truncations (seed {seed}); first ones: {first:#?}"
    );
    assert!(
        verdict.mismatches.is_empty(),
        "mismatched end states (seed {seed}); first ones: {first:#?}"
    );
    assert_eq!(
        anon_fin, 0,
        "a connection ended cleanly before its plan id (seed {seed})"
    );
    Ok(())
}

/// Transfers per front end in flight when a process is killed.
const KILL_STREAMS_PER_FRONT: usize = 4;
/// Download bytes each of them has received before the kill.
const KILL_FIRST_BYTES: usize = 100_000;

/// Reads `r` until it ends; fires `progress` once `threshold` bytes arrived.
async fn read_reporting<R: AsyncRead + Unpin>(
    r: &mut R,
    threshold: usize,
    progress: oneshot::Sender<()>,
) -> Saw {
    let mut progress = Some(progress);
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let end = loop {
        match r.read(&mut buf).await {
            Ok(0) => break End::Clean,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break End::Error(e.to_string()),
        }
        if got.len() >= threshold
            && let Some(p) = progress.take()
        {
            let _ = p.send(());
        }
    };
    Saw::of(&got, end)
}

/// The client side of a kill-round transfer: sends the plan id, reads until the end (the
/// write side stays open); `progress` fires once [`KILL_FIRST_BYTES`] arrived.
async fn held_transfer(
    fronts: &Fronts,
    plan: &Plan,
    progress: oneshot::Sender<()>,
) -> anyhow::Result<Saw> {
    if plan.front != Front::Konnectivity {
        let mut s = fronts.open(plan.front).await?;
        s.write_all(&plan.id.to_le_bytes()).await?;
        s.flush().await?;
        return Ok(read_reporting(&mut s, KILL_FIRST_BYTES, progress).await);
    }
    let authority = qualified(&fronts.cluster, fronts.target);
    let (tx, mut inbound, _) = konn_open(fronts.konn.clone(), authority, plan.id).await?;
    let mut progress = Some(progress);
    let mut got = Vec::new();
    let end = loop {
        match inbound.message().await {
            Ok(Some(p)) => match p.payload {
                Some(k::packet::Payload::Data(d)) => got.extend_from_slice(&d.data),
                Some(k::packet::Payload::CloseResponse(c)) if c.error.is_empty() => {
                    break End::Clean;
                }
                Some(k::packet::Payload::CloseResponse(c)) => {
                    break End::Error(format!("CLOSE_RSP {}", c.error));
                }
                other => break End::Error(format!("unexpected packet {other:?}")),
            },
            Ok(None) => break End::Clean,
            Err(s) => break End::Error(format!("status {s}")),
        }
        if got.len() >= KILL_FIRST_BYTES
            && let Some(p) = progress.take()
        {
            let _ = p.send(());
        }
    };
    drop(tx);
    Ok(Saw::of(&got, end))
}

/// [`KILL_STREAMS_PER_FRONT`] transfers per front end, each with part of its download
/// received, then `kill` (a SIGKILL of the agent or the broker): every client must be told
/// about the loss with an error, never a clean (short) end.
async fn kill_round(what: &str, kill: impl FnOnce(&mut Setup)) -> anyhow::Result<()> {
    let mut setup = Setup::start("c1", "", "").await?;
    let reg: Registry = Arc::default();
    let anon = Arc::new(Anonymous::default());
    let target_addr = target(Arc::clone(&reg), Arc::clone(&anon)).await?;
    let fronts = Arc::new(Fronts::new(&setup, target_addr).await?);
    let down = Bytes::from(vec![0x5a; KILL_FIRST_BYTES * 2]);
    let mut progress = Vec::new();
    let mut clients = Vec::new();
    for (i, front) in FRONTS
        .iter()
        .cycle()
        .take(FRONTS.len() * KILL_STREAMS_PER_FRONT)
        .enumerate()
    {
        let plan = Plan {
            id: i as u64 + 1,
            front: *front,
            up: Bytes::new(),
            down: down.clone(),
            client: ClientMode::Close,
            target: TargetMode::Hold {
                after: KILL_FIRST_BYTES,
            },
        };
        let (header, _header_rx) = oneshot::channel();
        let (report, _report_rx) = oneshot::channel();
        reg.lock().expect("registry").insert(
            plan.id,
            TargetSlot {
                down: plan.down.clone(),
                mode: plan.target,
                header,
                report,
            },
        );
        let (p_tx, p_rx) = oneshot::channel();
        progress.push(p_rx);
        let fronts = Arc::clone(&fronts);
        clients.push(tokio::spawn(async move {
            let saw = tokio::time::timeout(TRANSFER_DEADLINE, held_transfer(&fronts, &plan, p_tx))
                .await
                .unwrap_or_else(|_| Ok(Saw::of(&[], End::Stuck)));
            (plan.front, saw)
        }));
    }
    for p in progress {
        tokio::time::timeout(TRANSFER_DEADLINE, p)
            .await
            .map_err(|_| {
                anyhow::anyhow!("a transfer never got its first {KILL_FIRST_BYTES} bytes")
            })??;
    }
    let killed = Instant::now();
    kill(&mut setup);
    let (mut wrong, mut errors) = (Vec::new(), std::collections::BTreeSet::new());
    for c in clients {
        let (front, saw) = c.await?;
        let saw = saw?;
        match &saw.end {
            End::Error(e) => {
                errors.insert(format!(
                    "{front:?}: {}",
                    e.chars().take(100).collect::<String>()
                ));
            }
            other => wrong.push(format!("{front:?}: {other:?} after {} bytes", saw.len)),
        }
    }
    for e in &errors {
        println!("{what} killed: {e}");
    }
    println!(
        "{what} killed: {} transfers in flight all ended within {:.2?}",
        FRONTS.len() * KILL_STREAMS_PER_FRONT,
        killed.elapsed()
    );
    assert!(
        wrong.is_empty(),
        "{what} killed: transfers not ended with an error: {wrong:?}"
    );
    Ok(())
}

/// SIGKILL of the agent mid-transfer: every in-flight transfer ends with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_transfer_every_client_sees_an_error() -> anyhow::Result<()> {
    kill_round("agent", |s| s.agent.child.kill()).await
}

/// SIGKILL of the broker mid-transfer: every in-flight transfer ends with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_killed_mid_transfer_every_client_sees_an_error() -> anyhow::Result<()> {
    kill_round("broker", |s| s.broker.child.kill()).await
}
