//! The target server: this binary re-executed with `--target-server` inside the cluster
//! namespace, listening on 0.0.0.0 (so the agent reaches it on the namespace's loopback and the
//! direct path across the link on 10.77.0.2). The first byte a client sends selects the mode:
//! - `S` sink: counts bytes until EOF, answers the count (u64 LE) and closes;
//! - `T` + u64 LE milliseconds: timed source, sends for that long from the request, then
//!   half-closes (so a download ends cleanly, leaving nothing in flight on the link);
//! - `E` echo.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const BUF: usize = 256 << 10;

pub fn run(ready: &Path) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?
        .block_on(async move {
            let l = TcpListener::bind("0.0.0.0:0").await?;
            let info = serde_json::json!({ "port": l.local_addr()?.port() });
            tether_runtime::write_ready_file(ready, &info)?;
            loop {
                let (s, _) = l.accept().await?;
                tokio::spawn(async move {
                    let _ = serve(s).await;
                });
            }
        })
}

async fn serve(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut mode = [0u8; 1];
    if s.read(&mut mode).await? == 0 {
        return Ok(());
    }
    match mode[0] {
        b'S' => tether_e2e::benchkit::sink_count(&mut s, BUF).await?,
        b'T' => {
            let mut ms = [0u8; 8];
            s.read_exact(&mut ms).await?;
            let until = tokio::time::Instant::now() + Duration::from_millis(u64::from_le_bytes(ms));
            let buf = vec![0x5au8; BUF];
            while tokio::time::Instant::now() < until {
                // A stalled reader must not keep this task past the deadline forever.
                match tokio::time::timeout_at(until, s.write_all(&buf)).await {
                    Ok(r) => r?,
                    Err(_) => break,
                }
            }
            s.shutdown().await?;
            // Wait for the client to close (bounded), so the FIN is not followed by a reset.
            let mut sink = [0u8; 64];
            let _ = tokio::time::timeout(Duration::from_secs(30), s.read(&mut sink)).await;
        }
        b'E' => {
            let (mut r, mut w) = s.split();
            tokio::io::copy(&mut r, &mut w).await?;
            w.shutdown().await?;
        }
        _ => {}
    }
    Ok(())
}
