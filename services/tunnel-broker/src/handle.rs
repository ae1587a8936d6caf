//! [`TunnelHandle`]: what front ends, the registry and relays use to open streams on one HTTP/2
//! connection to an agent (or to a peer broker's relay), and the [`StreamGuard`] each open stream
//! holds. The connection itself is owned by its `tunnel::TunnelActor`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use h2::{RecvStream, SendStream};
use http::{Method, Request, StatusCode};
use tether_tunnel::watchdog::Progress;
use tether_tunnel::window::AdaptiveWindow;
use tether_tunnel::wire::{self, DialErrorKind};
use tether_tunnel::{DialError, Target};
use tokio::sync::Semaphore;

/// Time the agent has to answer the `hello` request.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// What front ends use to open streams on one agent tunnel. Cheap to share.
pub struct TunnelHandle {
    pub id: u64,
    pub cluster: String,
    pub agent: String,
    send: SendRequest<Bytes>,
    open: AtomicUsize,
    pending: Semaphore,
    max_pending: usize,
    draining: AtomicBool,
    /// Last HTTP/2 PING round trip on this connection, µs (0 = not measured yet).
    rtt_micros: std::sync::atomic::AtomicU64,
    /// Cancelling it drops the connection (open streams are reset).
    closer: tokio_util::sync::CancellationToken,
    /// The adaptive receive window of this connection (agent tunnels; relays keep theirs fixed).
    window: Option<Arc<AdaptiveWindow>>,
    /// Transport progress seen by the wedged-tunnel watchdog (agent tunnels).
    progress: Option<Arc<Progress>>,
}

impl std::fmt::Debug for TunnelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelHandle")
            .field("id", &self.id)
            .field("cluster", &self.cluster)
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

/// Decrements the tunnel's open-stream count when the stream ends.
pub struct StreamGuard(Arc<TunnelHandle>);

impl StreamGuard {
    /// The tunnel carrying the stream.
    pub fn tunnel(&self) -> &TunnelHandle {
        &self.0
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl TunnelHandle {
    /// A handle over an HTTP/2 connection on which this broker opens streams (to an agent, or
    /// to a peer broker's relay).
    pub fn new(
        id: u64,
        cluster: String,
        agent: String,
        send: SendRequest<Bytes>,
        max_pending_dials: usize,
    ) -> Self {
        Self {
            id,
            cluster,
            agent,
            send,
            open: AtomicUsize::new(0),
            pending: Semaphore::new(max_pending_dials),
            max_pending: max_pending_dials,
            draining: AtomicBool::new(false),
            rtt_micros: Default::default(),
            closer: Default::default(),
            window: None,
            progress: None,
        }
    }

    /// Records the connection's transport progress (tether_tunnel::watchdog).
    pub fn with_progress(mut self, progress: Arc<Progress>) -> Self {
        self.progress = Some(progress);
        self
    }

    /// The watchdog suspects the tunnel is wedged (bytes to the agent unanswered for half the
    /// stall timeout): new streams avoid it.
    pub fn is_suspect(&self) -> bool {
        self.progress.as_ref().is_some_and(|p| p.is_suspect())
    }

    /// How long bytes sent on the tunnel have gone unanswered, if they have.
    pub fn unanswered(&self) -> Option<Duration> {
        self.progress.as_ref().and_then(|p| p.unanswered())
    }

    /// Records the connection's adaptive receive window (shown in `/debug/tunnels`).
    pub fn with_window(mut self, window: Arc<AdaptiveWindow>) -> Self {
        self.window = Some(window);
        self
    }

    /// The receive window of this tunnel's streams now, if it adapts.
    pub fn stream_window(&self) -> Option<u32> {
        self.window.as_ref().map(|w| w.current())
    }

    /// Uses `closer` to close the connection (see [`TunnelHandle::refuse_and_close`]).
    pub fn with_closer(mut self, closer: tokio_util::sync::CancellationToken) -> Self {
        self.closer = closer;
        self
    }

    /// Closes the connection at once (open streams end with an error).
    pub fn close(&self) {
        self.closer.cancel();
    }

    /// Tells the agent why (`refused`, best effort) and closes the connection.
    pub async fn refuse_and_close(&self, reason: &str) {
        tell_refused(&self.send, reason).await;
        self.closer.cancel();
    }

    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Last measured round trip of the tunnel (HTTP/2 PING), if any.
    pub fn rtt(&self) -> Option<Duration> {
        match self.rtt_micros.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// Where the keepalive stores its measurements.
    pub fn rtt_cell(&self) -> &std::sync::atomic::AtomicU64 {
        &self.rtt_micros
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Asks the agent to dial `target`; on success returns the stream's two halves.
    ///
    /// `early` (bytes the client sent behind its request, bounded by the front end's head
    /// limit) leaves right behind the request's HEADERS, before the dial result: the agent
    /// writes it to the target once its dial succeeds and drops it when the dial fails. The
    /// client's first byte then costs no tunnel round trip of its own.
    pub async fn open(
        self: &Arc<Self>,
        target: &Target,
        stream_id: u64,
        timeout: Duration,
        trace_headers: &std::collections::HashMap<String, String>,
        early: &Bytes,
    ) -> Result<(SendStream<Bytes>, RecvStream, StreamGuard), DialError> {
        let _permit = self.pending.try_acquire().map_err(|_| {
            DialError::new(
                DialErrorKind::Overloaded,
                format!(
                    "too many pending dials on the tunnel of cluster {}",
                    self.cluster
                ),
            )
        })?;
        // The peer's SETTINGS_MAX_CONCURRENT_STREAMS bounds the streams of this connection. h2
        // would queue a request beyond it until some stream closes, so the client would wait out
        // the whole dial budget and get a misleading 504: refuse at once instead.
        let limit = self.send.current_max_send_streams();
        let dialling = self.max_pending - self.pending.available_permits();
        if self.open_streams() + dialling > limit {
            return Err(DialError::new(
                DialErrorKind::Overloaded,
                format!(
                    "the tunnel of cluster {} carries its limit of {limit} concurrent streams",
                    self.cluster
                ),
            ));
        }
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://tunnel{}", wire::PATH_DIAL))
            .header(wire::HEADER_CLUSTER, &target.cluster)
            .header(wire::HEADER_TARGET, target.wire_dest())
            .header(wire::HEADER_STREAM, stream_id.to_string())
            .header(
                wire::HEADER_DIAL_TIMEOUT_MS,
                timeout.as_millis().to_string(),
            );
        for (k, v) in trace_headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req
            .body(())
            .map_err(|e| DialError::new(DialErrorKind::BadRequest, e.to_string()))?;
        let lost = |e: h2::Error| {
            DialError::new(
                DialErrorKind::TunnelLost,
                format!("tunnel to cluster {} failed: {e}", self.cluster),
            )
        };
        // The agent enforces the dial timeout and answers 504; the margin covers the round trip.
        let budget = timeout + Duration::from_secs(2);
        let work = async {
            let mut send = self.send.clone().ready().await.map_err(lost)?;
            let (resp, mut tx) = send.send_request(req, false).map_err(lost)?;
            if !early.is_empty() {
                // Within the stream's initial window (the head limit is far below it); h2
                // queues it behind the HEADERS, both leave in one write of the connection.
                tx.send_data(early.clone(), false).map_err(lost)?;
            }
            let resp = resp.await.map_err(lost)?;
            Ok::<_, DialError>((resp, tx))
        };
        let (resp, tx) = tokio::time::timeout(budget, work).await.map_err(|_| {
            DialError::new(
                DialErrorKind::Timeout,
                format!(
                    "no dial answer from cluster {} within {} ms",
                    self.cluster,
                    budget.as_millis()
                ),
            )
        })??;
        if resp.status() != StatusCode::OK {
            let h = |n: &str| {
                resp.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
            };
            let kind = DialErrorKind::from_label(h(wire::HEADER_ERROR));
            let message = h(wire::HEADER_ERROR_MESSAGE);
            return Err(DialError::new(
                kind,
                if message.is_empty() {
                    format!("agent answered {}", resp.status())
                } else {
                    message.to_owned()
                },
            ));
        }
        self.open.fetch_add(1, Ordering::Relaxed);
        Ok((tx, resp.into_body(), StreamGuard(Arc::clone(self))))
    }

    /// Tells the agent this broker is draining.
    pub async fn send_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://tunnel{}", wire::PATH_DRAIN))
            .body(())
            .expect("valid request");
        let work = async {
            let mut send = self.send.clone().ready().await?;
            let (resp, _) = send.send_request(req, true)?;
            resp.await
        };
        if let Err(e) = tokio::time::timeout(HELLO_TIMEOUT, work).await {
            tracing::debug!(cluster = %self.cluster, error = %e, "drain notice not answered");
        }
    }
}

/// Sends `POST /tether.tunnel.v1/refused` with the reason; waits at most [`HELLO_TIMEOUT`].
pub(crate) async fn tell_refused(send: &SendRequest<Bytes>, reason: &str) {
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("https://tunnel{}", wire::PATH_REFUSED))
        .header(wire::HEADER_ERROR_MESSAGE, wire::header_safe(reason))
        .body(())
        .expect("valid request");
    let work = async {
        let mut send = send.clone().ready().await?;
        let (resp, _) = send.send_request(req, true)?;
        resp.await
    };
    let _ = tokio::time::timeout(HELLO_TIMEOUT, work).await;
}
