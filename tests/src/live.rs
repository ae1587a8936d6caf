//! Live traffic for tests that change the world underneath it: [`ContinuousEcho`] (a stream that
//! keeps moving data until told to stop, every byte checked) and [`CutRelay`] (a TCP relay
//! whose connections can be cut).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tether_test_support::wait_until_async;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::{Payload, Sha256};

/// How long a step of these helpers may take (a dial, progress, the end of a stream).
pub const LIVE_STEP: Duration = Duration::from_secs(30);

/// An echo stream that keeps moving data (writer and reader running at once) until stopped,
/// so a test can change the world underneath it and then verify every byte.
pub struct ContinuousEcho {
    received: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    writer: tokio::task::JoinHandle<anyhow::Result<(u64, String)>>,
    reader: tokio::task::JoinHandle<anyhow::Result<(u64, String)>>,
}

impl ContinuousEcho {
    /// Starts writing `chunk`-byte pieces of [`Payload`] to `s` (connected to an echo target)
    /// and reading them back. `yield_between` yields after each write, to keep the stream
    /// moving without saturating the machine's cores.
    pub fn start<S: AsyncRead + AsyncWrite + Send + 'static>(
        s: S,
        chunk: usize,
        yield_between: bool,
    ) -> Self {
        let (mut rd, mut wr) = tokio::io::split(s);
        let payload = Arc::new(Payload::new());
        let received = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let (mut h, mut sent, mut i) = (Sha256::new(), 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let c = payload.chunk(i, chunk);
                    h.update(c);
                    wr.write_all(c).await?;
                    sent += c.len() as u64;
                    i += 1;
                    if yield_between {
                        tokio::task::yield_now().await;
                    }
                }
                wr.shutdown().await?;
                anyhow::Ok((sent, h.hex()))
            })
        };
        let reader = {
            let received = Arc::clone(&received);
            tokio::spawn(async move {
                let (mut h, mut buf) = (Sha256::new(), vec![0u8; 256 << 10]);
                loop {
                    let n = rd.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                    received.fetch_add(n as u64, Ordering::Relaxed);
                }
                anyhow::Ok((received.load(Ordering::Relaxed), h.hex()))
            })
        };
        Self {
            received,
            stop,
            writer,
            reader,
        }
    }

    /// Bytes echoed back so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Waits until `more` bytes beyond the current count have come back.
    pub async fn wait_progress(&self, more: u64, what: &str) -> anyhow::Result<()> {
        let target = self.received() + more;
        wait_until_async(LIVE_STEP, what, || async {
            (self.received() >= target || self.reader.is_finished()).then_some(())
        })
        .await?;
        anyhow::ensure!(
            !self.reader.is_finished(),
            "the stream ended while it should be moving data ({what})"
        );
        Ok(())
    }

    /// Stops writing, half-closes, reads to EOF; checks every byte came back.
    pub async fn finish(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let (sent, sent_sha) = self.writer.await??;
        let (got, got_sha) = tokio::time::timeout(LIVE_STEP, self.reader).await???;
        anyhow::ensure!(got == sent, "{got} of {sent} bytes came back");
        anyhow::ensure!(got_sha == sent_sha, "the echoed bytes differ (SHA-256)");
        Ok(sent)
    }
}

/// A TCP relay to `upstream` whose current connections can be cut (both sockets dropped); new
/// connections are relayed again afterwards. Started closed ([`CutRelay::start_closed`]), it
/// drops every connection it accepts until [`CutRelay::open`]: a server that is not up yet.
pub struct CutRelay {
    pub addr: SocketAddr,
    cut: Arc<std::sync::Mutex<CancellationToken>>,
    closed: Arc<AtomicBool>,
    accepted: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CutRelay {
    fn drop(&mut self) {
        self.task.abort();
        if let Ok(c) = self.cut.lock() {
            c.cancel();
        }
    }
}

impl CutRelay {
    /// Listens on 127.0.0.1 (port 0) and relays every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with(upstream, false).await
    }

    /// Listens on 127.0.0.1 (port 0) and drops every connection until [`CutRelay::open`].
    pub async fn start_closed(upstream: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with(upstream, true).await
    }

    async fn start_with(upstream: SocketAddr, closed: bool) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = Arc::new(std::sync::Mutex::new(CancellationToken::new()));
        let closed = Arc::new(AtomicBool::new(closed));
        let accepted = Arc::new(AtomicU64::new(0));
        let task = {
            let (cut, accepted, closed) =
                (Arc::clone(&cut), Arc::clone(&accepted), Arc::clone(&closed));
            tokio::spawn(async move {
                while let Ok((mut down, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::Relaxed);
                    if closed.load(Ordering::Relaxed) {
                        continue;
                    }
                    let Ok(stop) = cut.lock().map(|c| c.clone()) else {
                        return;
                    };
                    tokio::spawn(async move {
                        let Ok(Ok(mut up)) =
                            tokio::time::timeout(LIVE_STEP, TcpStream::connect(upstream)).await
                        else {
                            return;
                        };
                        // A network path, not a sender: no Nagle delay of its own.
                        let _ = down.set_nodelay(true);
                        let _ = up.set_nodelay(true);
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                            _ = stop.cancelled() => {}
                        }
                    });
                }
            })
        };
        Ok(Self {
            addr,
            cut,
            closed,
            accepted,
            task,
        })
    }

    /// Relays the connections accepted from now on.
    pub fn open(&self) {
        self.closed.store(false, Ordering::Relaxed);
    }

    /// Connections accepted so far (dropped ones included).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Drops every connection relayed so far.
    pub fn cut(&self) {
        if let Ok(mut c) = self.cut.lock() {
            c.cancel();
            *c = CancellationToken::new();
        }
    }
}
