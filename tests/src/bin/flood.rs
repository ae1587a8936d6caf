//! `tether-flood`: the flooding client and the flooded cluster's sink of
//! `tests/tests/fairness.rs`, in a process of their own.
//!
//! Why a process: in production the flood's client runs on another machine, and the flooded
//! cluster's target in another cluster; only the broker is shared with the victims. On a 2-core
//! test machine everything shares the same cores, so a flood generator inside the test process
//! takes CPU from the victims' client and echo server — the measuring instrument — outside the
//! broker's control. Run as its own process, the test starts it at the lowest CPU priority
//! (`nice -n 19`), which models "other hardware" as closely as one machine can while the
//! broker, the thing under test, keeps its normal priority. The test checks that the flood is
//! still flooding (refusals or bytes still coming) while it measures the victims.
//!
//! Layout: a TCP sink on 127.0.0.1:0 (reads and discards; its address is the first stdout line,
//! `sink <addr>`), and `--loops` flood loops, each: `CONNECT <cluster>/<sink>` through the
//! broker's plain client port, push `--bytes-per-stream` in 256 KiB writes, close, repeat.
//! Commands on stdin, one per line: `flood` (loops run), `idle` (loops stop at once and reset
//! their streams), `stats` (prints `stats {json}`: streams opened, refusals, bytes pushed, refusals
//! that were not a 503 naming a budget). EOF ends the process.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::Parser;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};

/// Size of one flood write.
const CHUNK_BYTES: usize = 256 << 10;

#[derive(Parser)]
struct Args {
    /// The broker's plain client (CONNECT) address.
    #[arg(long)]
    broker: SocketAddr,
    /// The flooded cluster.
    #[arg(long)]
    cluster: String,
    /// Concurrent flood loops.
    #[arg(long)]
    loops: usize,
    /// Bytes a flood stream pushes before it closes and dials again.
    #[arg(long, default_value_t = 4 << 20)]
    bytes_per_stream: usize,
}

#[derive(Default)]
struct Stats {
    opened: AtomicU64,
    refused: AtomicU64,
    pushed: AtomicU64,
    bad: std::sync::Mutex<Vec<String>>,
}

async fn sink() -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let a = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut b = vec![0u8; CHUNK_BYTES];
                while matches!(s.read(&mut b).await, Ok(n) if n > 0) {}
            });
        }
    });
    Ok(a)
}

async fn flood_loop(
    args: Arc<Args>,
    authority: String,
    on: Arc<tokio::sync::watch::Sender<bool>>,
    stats: Arc<Stats>,
) {
    let chunk = vec![0x5au8; CHUNK_BYTES];
    loop {
        if !*on.borrow() {
            let mut wake = on.subscribe();
            let _ = wake.wait_for(|on| *on).await;
            continue;
        }
        match tether_e2e::connect(args.broker, &authority, Some(tether_e2e::OPS_TOKEN)).await {
            Ok(Ok(mut s)) => {
                stats.opened.fetch_add(1, Ordering::Relaxed);
                let mut sent = 0;
                let mut idle = on.subscribe();
                while sent < args.bytes_per_stream && *on.borrow() {
                    tokio::select! {
                        r = s.write_all(&chunk) => if r.is_err() { break },
                        _ = idle.wait_for(|on| !on) => break,
                    }
                    sent += chunk.len();
                    stats
                        .pushed
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
                if !*on.borrow() {
                    // Going idle: reset the stream rather than have the broker drain what is
                    // still buffered at the paced rate (the test waits for the flood's streams
                    // to end before it measures the victims unloaded).
                    let _ = s.set_zero_linger();
                }
            }
            Ok(Err((code, body))) => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                if code != 503 || !body.contains("budgets.max_") {
                    stats
                        .bad
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(format!("{code} {body}"));
                }
            }
            // The broker closed a connection it could not serve: counted by the broker.
            Err(_) => {}
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    let sink = sink().await?;
    let authority = tether_e2e::qualified(&args.cluster, sink);
    let on = Arc::new(tokio::sync::watch::Sender::new(false));
    let stats = Arc::new(Stats::default());
    for _ in 0..args.loops {
        tokio::spawn(flood_loop(
            Arc::clone(&args),
            authority.clone(),
            Arc::clone(&on),
            Arc::clone(&stats),
        ));
    }
    let mut out = tokio::io::stdout();
    out.write_all(format!("sink {sink}\n").as_bytes()).await?;
    out.flush().await?;
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(cmd) = lines.next_line().await? {
        match cmd.trim() {
            "flood" => {
                on.send_replace(true);
            }
            "idle" => {
                on.send_replace(false);
            }
            "stats" => {
                let s = serde_json::json!({
                    "opened": stats.opened.load(Ordering::Relaxed),
                    "refused": stats.refused.load(Ordering::Relaxed),
                    "pushed": stats.pushed.load(Ordering::Relaxed),
                    "bad": *stats.bad.lock().unwrap_or_else(|p| p.into_inner()),
                });
                out.write_all(format!("stats {s}\n").as_bytes()).await?;
                out.flush().await?;
            }
            other => anyhow::bail!("unknown command {other:?} (flood, idle, stats)"),
        }
    }
    Ok(())
}
