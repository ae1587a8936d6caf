//! Data integrity and concurrency through real broker and agent processes (real TLS, real TCP
//! on 127.0.0.1): large checksummed transfers, 1,000+ concurrent streams on one tunnel,
//! half-close in both directions, and one stalled reader not slowing the others.
//!
//! The heavy tests take [`HEAVY`] so they do not measure each other.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tether_e2e::{Payload, Setup, Sha256, echo_transfer, metric, rate};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Serialises the CPU-heavy tests of this file.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Bytes sent each way by [`large_transfer_is_intact`]: 1 GiB each way (2 GiB through the
/// tunnel) runs in ~20 s in a debug build on 2 cores. Override with `TETHER_E2E_TRANSFER_MIB`.
const LARGE_TRANSFER_MIB: u64 = 1024;
/// Bytes each way of the ignored multi-GB run (`--ignored`); also overridable.
const HUGE_TRANSFER_MIB: u64 = 4096;

fn transfer_bytes(default_mib: u64) -> u64 {
    std::env::var("TETHER_E2E_TRANSFER_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_mib)
        << 20
}

async fn checksummed_echo(mib: u64) -> anyhow::Result<()> {
    let _heavy = HEAVY.lock().await;
    let setup = Setup::start("c1", "", "").await?;
    let total = transfer_bytes(mib);
    let s = setup.connect_echo().await?;
    let t = echo_transfer(s, Arc::new(Payload::new()), total).await?;
    println!(
        "echo transfer of {} MiB each way ({} MiB through the tunnel) in {:.2?}: {} each way",
        total >> 20,
        (2 * total) >> 20,
        t.elapsed,
        rate(t.throughput())
    );
    assert_eq!(t.sent, total);
    assert_eq!(t.received, total, "echo returned a different byte count");
    assert_eq!(
        t.sent_sha256, t.received_sha256,
        "SHA-256 of the echo differs"
    );
    Ok(())
}

/// 1 GiB each way through one stream, SHA-256 on both sides; prints the throughput.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfer_is_intact() -> anyhow::Result<()> {
    checksummed_echo(LARGE_TRANSFER_MIB).await
}

/// Multi-GB (4 GiB each way, 8 GiB through the tunnel): > 60 s in a debug build, so opt-in:
/// `cargo test -p tether-e2e --test tunnel_data -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "multi-GB: ~75 s in a debug build"]
async fn multi_gigabyte_transfer_is_intact() -> anyhow::Result<()> {
    checksummed_echo(HUGE_TRANSFER_MIB).await
}

/// Number of streams open at once in [`thousand_concurrent_streams`].
const CONCURRENT_STREAMS: usize = 1024;
/// Bytes each concurrent stream echoes.
const PER_STREAM_BYTES: usize = 64 << 10;

/// 1,024 streams open at the same time through one tunnel (checked on both processes'
/// metrics), then each echoes its own 64 KiB, verified byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_streams() -> anyhow::Result<()> {
    let _heavy = HEAVY.lock().await;
    let setup = Arc::new(Setup::start("c1", "", "").await?);
    let started = Instant::now();
    // Open every stream first (at most 128 CONNECTs in flight, well under the broker's pending
    // dial cap), and keep them all open.
    let opening = Arc::new(tokio::sync::Semaphore::new(128));
    let mut opens = tokio::task::JoinSet::new();
    for i in 0..CONCURRENT_STREAMS {
        let setup = Arc::clone(&setup);
        let opening = Arc::clone(&opening);
        opens.spawn(async move {
            let _p = opening.acquire().await?;
            anyhow::Ok((i, setup.connect_echo().await?))
        });
    }
    let mut streams = Vec::with_capacity(CONCURRENT_STREAMS);
    while let Some(r) = opens.join_next().await {
        streams.push(r??);
    }
    let opened = started.elapsed();
    let broker_open = metric(
        setup.broker.admin_addr,
        "tether_broker_open_streams",
        &[("frontend", "connect")],
    )
    .await?;
    let agent_open = metric(setup.agent.admin_addr, "tether_agent_open_streams", &[]).await?;
    assert!(
        broker_open >= CONCURRENT_STREAMS as f64,
        "broker reports {broker_open} open streams, expected {CONCURRENT_STREAMS}"
    );
    assert!(
        agent_open >= CONCURRENT_STREAMS as f64,
        "agent reports {agent_open} open streams, expected {CONCURRENT_STREAMS}"
    );
    let (_, tunnels) = tether_e2e::admin_get(setup.broker.admin_addr, "/debug/tunnels").await?;
    assert_eq!(
        tunnels.matches("\"cluster\":\"c1\"").count(),
        1,
        "all streams must share one tunnel: {tunnels}"
    );

    let payload = Arc::new(Payload::new());
    let mut echoes = tokio::task::JoinSet::new();
    for (i, s) in streams {
        let payload = Arc::clone(&payload);
        echoes.spawn(async move {
            let sent = payload.chunk(i as u64, PER_STREAM_BYTES).to_vec();
            let (mut rd, mut wr) = s.into_split();
            let writer = tokio::spawn(async move {
                wr.write_all(&sent).await?;
                wr.shutdown().await?;
                anyhow::Ok(sent)
            });
            let mut back = Vec::with_capacity(PER_STREAM_BYTES);
            rd.read_to_end(&mut back)
                .await
                .with_context(|| format!("stream {i}: read"))?;
            let sent = writer.await??;
            anyhow::ensure!(
                back == sent,
                "stream {i}: echo differs ({} bytes back of {})",
                back.len(),
                sent.len()
            );
            anyhow::Ok(())
        });
    }
    let mut verified = 0;
    while let Some(r) = echoes.join_next().await {
        r??;
        verified += 1;
    }
    assert_eq!(verified, CONCURRENT_STREAMS);
    // Every stream is released on both sides (no leak).
    for (admin, name) in [
        (setup.broker.admin_addr, "tether_broker_open_streams"),
        (setup.agent.admin_addr, "tether_agent_open_streams"),
    ] {
        tether_test_support::wait_until_async(
            Duration::from_secs(20),
            &format!("{name} back to 0"),
            || async { (metric(admin, name, &[]).await.ok()? == 0.0).then_some(()) },
        )
        .await?;
    }
    println!(
        "{CONCURRENT_STREAMS} concurrent streams: opened in {opened:.2?}, all verified after {:.2?}",
        started.elapsed()
    );
    Ok(())
}

/// A target that accepts one connection and hands it to `f`.
async fn one_connection_target<F, Fut>(f: F) -> anyhow::Result<std::net::SocketAddr>
where
    F: FnOnce(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        if let Ok((s, _)) = l.accept().await {
            f(s).await;
        }
    });
    Ok(addr)
}

/// The client shuts down its write side; the target sees EOF after all the bytes, and its reply
/// (sent after that EOF) still reaches the client, followed by a clean EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_half_close_still_gets_reply() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
    let target = one_connection_target(|mut s| async move {
        let mut got = Vec::new();
        let r = s.read_to_end(&mut got).await.map(|_| got.len());
        let reply = format!("target saw EOF after {:?} bytes", r.as_ref().ok());
        let _ = s.write_all(reply.as_bytes()).await;
        let _ = s.shutdown().await;
        let _ = seen_tx.send(r.map_err(|e| e.to_string()));
    })
    .await?;
    let mut s = tether_e2e::connect_ok(
        setup.broker.client_addr,
        &tether_e2e::qualified("c1", target),
    )
    .await?;
    let request = vec![7u8; 300_000];
    s.write_all(&request).await?;
    s.shutdown().await?;
    let seen = tokio::time::timeout(Duration::from_secs(10), seen_rx)
        .await
        .context("target never saw EOF")??;
    assert_eq!(
        seen,
        Ok(request.len()),
        "target must see all bytes then a clean EOF"
    );
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut reply)).await??;
    assert_eq!(reply, "target saw EOF after Some(300000) bytes");
    Ok(())
}

/// The target shuts down its write side first: the client reads everything then a clean EOF,
/// and can still send; the target receives it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_half_close_client_keeps_sending() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let banner = vec![42u8; 500_000];
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
    let target = {
        let banner = banner.clone();
        one_connection_target(|mut s| async move {
            let _ = s.write_all(&banner).await;
            let _ = s.shutdown().await;
            let mut got = Vec::new();
            let r = s.read_to_end(&mut got).await.map(|_| got);
            let _ = seen_tx.send(r.map_err(|e| e.to_string()));
        })
        .await?
    };
    let mut s = tether_e2e::connect_ok(
        setup.broker.client_addr,
        &tether_e2e::qualified("c1", target),
    )
    .await?;
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await??;
    assert_eq!(
        got.len(),
        banner.len(),
        "client must read the banner then EOF"
    );
    assert!(got == banner);
    // The client's direction is still open after the target's half-close.
    let late = b"sent after the target's EOF".repeat(1000);
    s.write_all(&late).await?;
    s.shutdown().await?;
    let seen = tokio::time::timeout(Duration::from_secs(10), seen_rx)
        .await
        .context("target never finished reading")??;
    assert_eq!(seen.map(|v| v == late), Ok(true));
    Ok(())
}

/// Bytes moved by one healthy-stream measurement in [`stalled_reader_does_not_slow_others`].
const HEALTHY_BYTES: u64 = 128 << 20;

/// One stream whose client never reads (its windows and socket buffers fill up and it stalls in
/// both directions) must not slow a healthy stream on the same tunnel: the healthy stream keeps
/// ≥ 0.5× the throughput it had without the stalled one (the strict 90 % is the benchmark's).
/// Afterwards the stalled stream resumes and its bytes are verified. On a shared machine one
/// measurement can be unlucky, so up to three rounds run and the best ratio counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_reader_does_not_slow_others() -> anyhow::Result<()> {
    let _heavy = HEAVY.lock().await;
    let setup = Setup::start("c1", "", "").await?;
    let payload = Arc::new(Payload::new());
    let mut best = 0.0f64;
    for round in 1..=3 {
        let alone = measure_healthy(&setup, &payload).await?;
        let stalled = StalledStream::start(&setup, &payload).await?;
        let with_stalled = measure_healthy(&setup, &payload).await?;
        stalled.resume_and_verify().await?;
        let ratio = with_stalled / alone;
        println!(
            "round {round}: healthy stream alone {}, with a stalled stream on the tunnel {} ({ratio:.2}×)",
            rate(alone),
            rate(with_stalled)
        );
        best = best.max(ratio);
        if best >= 0.5 {
            break;
        }
    }
    assert!(
        best >= 0.5,
        "a stalled stream slowed a healthy one to {best:.2}× of its throughput"
    );
    Ok(())
}

/// Throughput (bytes/s each way) of one echo stream moving [`HEALTHY_BYTES`].
async fn measure_healthy(setup: &Setup, payload: &Arc<Payload>) -> anyhow::Result<f64> {
    let s = setup.connect_echo().await?;
    let t = echo_transfer(s, Arc::clone(payload), HEALTHY_BYTES).await?;
    anyhow::ensure!(t.intact(), "healthy stream corrupted: {t:?}");
    Ok(t.throughput())
}

/// How long writes must make no progress before a stream counts as stalled.
const STALL_QUIET: Duration = Duration::from_secs(1);
/// How much more a stalled stream may write later on a loaded machine (kernel buffers that
/// autotune upwards); a flow-control leak would move far more.
const STALL_SLACK: u64 = 16 << 20;

/// An echo stream whose client writes but never reads, until resumed.
struct StalledStream {
    rd: tokio::net::tcp::OwnedReadHalf,
    writer: tokio::task::JoinHandle<anyhow::Result<(u64, String)>>,
    written: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    stalled_at: u64,
}

impl StalledStream {
    /// Opens the stream and writes until writes make no progress for [`STALL_QUIET`] (every
    /// buffer and window on the way is full).
    async fn start(setup: &Setup, payload: &Arc<Payload>) -> anyhow::Result<Self> {
        let (rd, mut wr) = setup.connect_echo().await?.into_split();
        let written = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (payload, written, stop) =
                (Arc::clone(payload), Arc::clone(&written), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut h = Sha256::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let c = payload.chunk(i, 64 << 10);
                    h.update(c);
                    wr.write_all(c).await?;
                    written.fetch_add(c.len() as u64, Ordering::Relaxed);
                    i += 1;
                }
                wr.shutdown().await?;
                anyhow::Ok((written.load(Ordering::Relaxed), h.hex()))
            })
        };
        let mut last = (0, Instant::now());
        tether_test_support::wait_until_async(Duration::from_secs(30), "stream to stall", || {
            let now = written.load(Ordering::Relaxed);
            if now != last.0 {
                last = (now, Instant::now());
            }
            let stalled = now > 0 && last.1.elapsed() > STALL_QUIET;
            async move { stalled.then_some(()) }
        })
        .await?;
        let stalled_at = written.load(Ordering::Relaxed);
        println!(
            "stalled stream: writes stopped after {} MiB",
            stalled_at >> 20
        );
        anyhow::ensure!(
            stalled_at > 8 << 20,
            "a stalled stream fills at least its two 4 MiB stream windows; it stalled at {stalled_at} bytes"
        );
        Ok(Self {
            rd,
            writer,
            written,
            stop,
            stalled_at,
        })
    }

    /// Checks it stayed stalled (a loaded machine may still drain a socket buffer that grew by
    /// autotuning, so up to [`STALL_SLACK`] more is allowed; flow control that leaks would let
    /// the writer push hundreds of MiB meanwhile), then reads everything back and verifies it.
    async fn resume_and_verify(mut self) -> anyhow::Result<()> {
        let now = self.written.load(Ordering::Relaxed);
        anyhow::ensure!(
            now <= self.stalled_at + STALL_SLACK,
            "the stalled stream moved {} MiB more while its reader was stopped (allowed {} MiB)",
            (now - self.stalled_at) >> 20,
            STALL_SLACK >> 20
        );
        self.stop.store(true, Ordering::Relaxed);
        let mut h = Sha256::new();
        let mut received = 0u64;
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = self.rd.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            received += n as u64;
        }
        let (sent, sent_sha) = self.writer.await??;
        anyhow::ensure!(
            received == sent,
            "stalled stream: {received} of {sent} bytes came back"
        );
        anyhow::ensure!(
            h.hex() == sent_sha,
            "stalled stream's echo differs after resuming"
        );
        Ok(())
    }
}

/// Bytes a client sends right behind its CONNECT head, in the same write (before the 200), are
/// delivered first and in order — on the plain and on the TLS client port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_pipelined_after_connect_head_arrive() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let authority = setup.echo_authority();
    let head = format!(
        "CONNECT {authority} HTTP/1.1\r\nproxy-authorization: Bearer {}\r\n\r\npipelined-1|",
        tether_e2e::OPS_TOKEN
    );
    let plain = tokio::net::TcpStream::connect(setup.broker.client_addr).await?;
    let cfg = tether_e2e::client_tls_config(&setup.hub.pki.ca_path(), &[b"http/1.1"], None)?;
    let tls = tether_e2e::tls_connect(setup.broker.client_tls_addr, cfg).await?;
    async fn check<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
        s: S,
        head: &str,
    ) -> anyhow::Result<()> {
        let mut s = match tether_e2e::send_head(s, head.as_bytes()).await? {
            Ok(s) => s,
            Err((code, body)) => anyhow::bail!("{code} {body}"),
        };
        s.write_all(b"then-2").await?;
        s.shutdown().await?;
        let mut back = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut back)).await??;
        anyhow::ensure!(
            back == b"pipelined-1|then-2",
            "got {:?}",
            String::from_utf8_lossy(&back)
        );
        Ok(())
    }
    check(plain, &head).await.context("plain CONNECT")?;
    check(tls, &head).await.context("TLS CONNECT")?;
    Ok(())
}

/// Early data rides the stream open (issue 16): the broker forwards the bytes read with the
/// CONNECT head right behind the dial request, the agent writes them once its dial succeeds.
/// A client sending its head and 6,000 bytes in one write, without waiting for the `200`, gets
/// the `200` and then the target's answer, which the target sends only once it has all 6,000
/// bytes in order (the part read with the head and the rest); the broker counts every one of
/// them. A dial that is refused still answers `502` with the reason and a clean end, the early
/// bytes dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_data_rides_the_dial_and_a_refused_dial_still_answers() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let early: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
    let want = early.clone();
    let target = one_connection_target(move |mut s| async move {
        let mut got = vec![0u8; want.len()];
        if s.read_exact(&mut got).await.is_ok() && got == want {
            let _ = s.write_all(b"all early bytes arrived").await;
        }
        let _ = s.shutdown().await;
    })
    .await?;
    let refusing = tether_e2e::RefusingPort::new()?;
    let closed = refusing.addr;
    // Head and early bytes in one write; the whole answer up to the broker's close.
    let exchange = |to: std::net::SocketAddr| {
        let mut first = format!(
            "CONNECT {} HTTP/1.1\r\nproxy-authorization: Bearer {}\r\n\r\n",
            tether_e2e::qualified("c1", to),
            tether_e2e::OPS_TOKEN
        )
        .into_bytes();
        first.extend_from_slice(&early);
        let broker = setup.broker.client_addr;
        async move {
            let mut s = tokio::net::TcpStream::connect(broker).await?;
            s.set_nodelay(true)?;
            s.write_all(&first).await?;
            let mut answer = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
                .await
                .context("the answer never ended")??;
            anyhow::Ok(String::from_utf8_lossy(&answer).into_owned())
        }
    };
    let answer = exchange(target).await?;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(
        answer.ends_with("\r\n\r\nall early bytes arrived"),
        "the target must get all early bytes in order: {answer:?}"
    );
    let counted = metric(
        setup.broker.admin_addr,
        "tether_broker_bytes_total",
        &[("direction", "to_cluster")],
    )
    .await?;
    assert!(
        counted >= early.len() as f64,
        "broker counted {counted} bytes to the cluster, sent {}",
        early.len()
    );
    let refused = exchange(closed).await?;
    assert!(refused.starts_with("HTTP/1.1 502"), "{refused:?}");
    assert!(refused.contains("tether-error: refused"), "{refused:?}");
    Ok(())
}
