//! HTTP/2 settings of the tunnel, the same on both ends.
//!
//! Isolation rule (measured on the prototype): the connection window must be at least
//! `max_concurrent_streams × stream_window`, otherwise a few stalled streams exhaust the
//! connection window and block every healthy one. We therefore use the largest connection
//! window HTTP/2 allows and bound memory with the stream window × the number of streams that
//! can actually hold unread data. An idle stream holds no buffer at all: its window is credit,
//! not memory.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Largest HTTP/2 window (2^31 − 1).
pub const MAX_WINDOW: u32 = (1 << 31) - 1;
/// Default per-stream receive window: 4 MiB ≈ 670 Mbit/s at 50 ms RTT per stream.
pub const DEFAULT_STREAM_WINDOW: u32 = 4 << 20;
/// Default cap of the adaptive stream window (see `window`): 16 MiB keeps one stream
/// at 1 Gbit/s up to ~130 ms RTT.
pub const DEFAULT_MAX_STREAM_WINDOW: u32 = 16 << 20;
/// Default HTTP/2 frame size (the maximum is 16 MiB − 1; 256 KiB halves per-frame overhead
/// against the 16 KiB default without hurting latency).
pub const DEFAULT_MAX_FRAME: u32 = 256 << 10;
/// Default cap of concurrent streams on one tunnel.
pub const DEFAULT_MAX_STREAMS: u32 = 20_000;
/// Default per-stream send buffer held by h2 before flow-control capacity is granted.
pub const DEFAULT_SEND_BUFFER: usize = 1 << 20;
/// Default wedged-tunnel stall timeout (see `stall_timeout`).
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Default read size from sockets.
pub const DEFAULT_READ_CHUNK: usize = 256 << 10;
/// Room above one frame in the default TLS send buffer (record headers and tags of a frame
/// are under 1 KiB; the rest lets a control frame join it).
pub const TLS_SEND_BUFFER_SLACK: usize = 64 << 10;
/// The TLS send buffer with the default frame size (see `tls_send_buffer_bytes`): what the
/// broker's client TLS port and the SDK's connections use.
pub const DEFAULT_TLS_SEND_BUFFER: usize = DEFAULT_MAX_FRAME as usize + TLS_SEND_BUFFER_SLACK;

/// Default `tcp_notsent_lowat_bytes`: on an emulated 1 Gbit/s link it took a 64 B round trip
/// under a bulk upload on the same tunnel from +14–26 ms to +4.3 ms over direct; 128 KiB
/// (+2.2 ms) cost broker+agent 8–10 % more CPU per GB on loopback bulk, 512 KiB nothing
/// measurable (docs/benchmarks.md).
pub const DEFAULT_TCP_NOTSENT_LOWAT: u32 = 512 << 10;
/// Smallest non-zero `tcp_notsent_lowat_bytes` (below it a socket wakes its writer for every
/// few packets).
pub const MIN_TCP_NOTSENT_LOWAT: u32 = 16 << 10;

/// Smallest `tls_send_buffer_bytes`: one full TLS record and its overhead.
pub const MIN_TLS_SEND_BUFFER: usize = 17 << 10;
/// Largest `tls_send_buffer_bytes` (a bound on what one connection queues in rustls).
pub const MAX_TLS_SEND_BUFFER: usize = 16 << 20;

/// Tunnel HTTP/2 and liveness settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TunnelSettings {
    /// Per-stream receive window in bytes (the base of the adaptive window).
    pub stream_window_bytes: u32,
    /// Cap of the adaptive per-stream window: each end raises its receive window up to this
    /// while the measured bytes per round trip show the window limits the tunnel; a value not
    /// above `stream_window_bytes` turns adaptation off.
    pub max_stream_window_bytes: u32,
    /// Connection receive window in bytes.
    pub connection_window_bytes: u32,
    pub max_frame_bytes: u32,
    /// Concurrent streams the agent accepts on one tunnel.
    pub max_concurrent_streams: u32,
    pub send_buffer_bytes: usize,
    pub read_chunk_bytes: usize,
    /// Encrypted bytes rustls may queue for the socket of a tunnel or relay connection before
    /// a write waits; unset: one `max_frame_bytes` frame plus [`TLS_SEND_BUFFER_SLACK`].
    /// rustls's own default (64 KiB) cut every 256 KiB frame into four `writev` calls, each
    /// waking the peer for a quarter of a frame; with room for a whole frame it goes out in
    /// one (broker+agent CPU-s/GB 10–15 % lower, docs/benchmarks.md). It is also what waits
    /// in user space ahead of a later frame while the socket is full, so it stays near a frame.
    pub tls_send_buffer_bytes: Option<usize>,
    /// `TCP_NOTSENT_LOWAT` on the sockets of tunnel and relay connections: the kernel keeps at
    /// most this many bytes queued beyond what is in flight, so the multiplexer's frames (a
    /// PING, a small stream's reply) wait behind that much bulk data instead of a send buffer
    /// autotuned to megabytes. 0 leaves the kernel default (unlimited).
    pub tcp_notsent_lowat_bytes: u32,
    /// Interval between HTTP/2 PINGs.
    #[serde(with = "humantime_serde")]
    pub keepalive_interval: Duration,
    /// A PING unanswered this long declares the peer dead.
    #[serde(with = "humantime_serde")]
    pub keepalive_timeout: Duration,
    /// A write to a socket that makes no progress this long aborts the stream (both ways).
    #[serde(with = "humantime_serde")]
    pub write_stall_timeout: Duration,
    /// Time allowed for TCP connect + TLS + HTTP/2 handshake of a tunnel.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Wedged-tunnel watchdog (tether_tunnel::watchdog): bytes written to the peer and not
    /// answered by any byte back for this long tear the tunnel down (suspect at half of it).
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// Broker↔agent protocol: `mux` offers (agent) or accepts (broker) `tether-tunnel/2` and
    /// falls back to `tether-tunnel/1` with a peer that lacks it; `h2` speaks only
    /// `tether-tunnel/1` (HTTP/2).
    pub protocol: TunnelProtocol,
}

/// See [`TunnelSettings::protocol`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TunnelProtocol {
    #[default]
    Mux,
    H2,
}

impl TunnelProtocol {
    /// ALPN ids offered (agent) or accepted (broker) for agent tunnels, preferred first.
    pub fn alpn(self) -> &'static [&'static [u8]] {
        const BOTH: &[&[u8]] = &[b"tether-tunnel/2", b"tether-tunnel/1"];
        const V1: &[&[u8]] = &[b"tether-tunnel/1"];
        match self {
            Self::Mux => BOTH,
            Self::H2 => V1,
        }
    }
}

impl Default for TunnelSettings {
    fn default() -> Self {
        Self {
            stream_window_bytes: DEFAULT_STREAM_WINDOW,
            max_stream_window_bytes: DEFAULT_MAX_STREAM_WINDOW,
            connection_window_bytes: MAX_WINDOW,
            max_frame_bytes: DEFAULT_MAX_FRAME,
            max_concurrent_streams: DEFAULT_MAX_STREAMS,
            send_buffer_bytes: DEFAULT_SEND_BUFFER,
            read_chunk_bytes: DEFAULT_READ_CHUNK,
            tls_send_buffer_bytes: None,
            tcp_notsent_lowat_bytes: DEFAULT_TCP_NOTSENT_LOWAT,
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
            write_stall_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(10),
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            protocol: TunnelProtocol::Mux,
        }
    }
}

impl TunnelSettings {
    /// Checks ranges; errors name the field.
    pub fn validate(&self, prefix: &str) -> Result<(), (String, String)> {
        let f = |n: &str| format!("{prefix}{n}");
        if !(65_535..=MAX_WINDOW).contains(&self.stream_window_bytes) {
            return Err((
                f("stream_window_bytes"),
                "must be between 65535 and 2^31-1".into(),
            ));
        }
        if self.max_stream_window_bytes > MAX_WINDOW {
            return Err((
                f("max_stream_window_bytes"),
                "must be at most 2^31-1".into(),
            ));
        }
        if self.connection_window_bytes < self.stream_window_bytes {
            return Err((
                f("connection_window_bytes"),
                "must be at least stream_window_bytes".into(),
            ));
        }
        if !(16_384..=16_777_215).contains(&self.max_frame_bytes) {
            return Err((
                f("max_frame_bytes"),
                "must be between 16384 and 16777215".into(),
            ));
        }
        if self.max_concurrent_streams == 0 {
            return Err((f("max_concurrent_streams"), "must be at least 1".into()));
        }
        if self.read_chunk_bytes < 1024 {
            return Err((f("read_chunk_bytes"), "must be at least 1024".into()));
        }
        if self.tcp_notsent_lowat_bytes != 0 && self.tcp_notsent_lowat_bytes < MIN_TCP_NOTSENT_LOWAT
        {
            return Err((
                f("tcp_notsent_lowat_bytes"),
                format!("must be 0 (the kernel default) or at least {MIN_TCP_NOTSENT_LOWAT}"),
            ));
        }
        if let Some(n) = self.tls_send_buffer_bytes
            && !(MIN_TLS_SEND_BUFFER..=MAX_TLS_SEND_BUFFER).contains(&n)
        {
            return Err((
                f("tls_send_buffer_bytes"),
                format!("must be between {MIN_TLS_SEND_BUFFER} and {MAX_TLS_SEND_BUFFER}"),
            ));
        }
        if self.keepalive_interval.is_zero() || self.keepalive_timeout.is_zero() {
            return Err((
                f("keepalive_interval"),
                "keepalive interval and timeout must be > 0".into(),
            ));
        }
        if self.stall_timeout < Duration::from_millis(100) {
            return Err((
                f("stall_timeout"),
                "must be at least 100ms (a healthy peer needs a round trip to answer)".into(),
            ));
        }
        if self.handshake_timeout.is_zero() || self.write_stall_timeout.is_zero() {
            return Err((f("handshake_timeout"), "timeouts must be > 0".into()));
        }
        Ok(())
    }

    /// What rustls may queue for a tunnel's or relay's socket (`tls_send_buffer_bytes`), for
    /// `set_buffer_limit` on the connection right after its handshake.
    pub fn tls_send_buffer(&self) -> Option<usize> {
        Some(
            self.tls_send_buffer_bytes
                .unwrap_or(self.max_frame_bytes as usize + TLS_SEND_BUFFER_SLACK),
        )
    }

    /// Applies `tcp_notsent_lowat_bytes` to the TCP socket of a tunnel or relay connection;
    /// a socket that refuses the option keeps the kernel default (logged, not fatal).
    pub fn limit_unsent(&self, tcp: &impl std::os::fd::AsFd) {
        if self.tcp_notsent_lowat_bytes == 0 {
            return;
        }
        if let Err(e) =
            socket2::SockRef::from(tcp).set_tcp_notsent_lowat(self.tcp_notsent_lowat_bytes)
        {
            tracing::debug!(error = %e, "TCP_NOTSENT_LOWAT not set on a tunnel socket");
        }
    }

    /// The adaptive window state of one tunnel end.
    pub fn adaptive_window(&self) -> std::sync::Arc<crate::window::AdaptiveWindow> {
        crate::window::AdaptiveWindow::new(self.stream_window_bytes, self.max_stream_window_bytes)
    }

    /// Builder for the agent side (HTTP/2 server).
    pub fn server_builder(&self) -> h2::server::Builder {
        let mut b = h2::server::Builder::new();
        b.initial_window_size(self.stream_window_bytes)
            .initial_connection_window_size(self.connection_window_bytes)
            .max_frame_size(self.max_frame_bytes)
            .max_concurrent_streams(self.max_concurrent_streams)
            .max_send_buffer_size(self.send_buffer_bytes)
            .max_header_list_size(16 << 10)
            .max_concurrent_reset_streams(1024);
        b
    }

    /// Builder for the broker side (HTTP/2 client).
    pub fn client_builder(&self) -> h2::client::Builder {
        let mut b = h2::client::Builder::new();
        b.initial_window_size(self.stream_window_bytes)
            .initial_connection_window_size(self.connection_window_bytes)
            .max_frame_size(self.max_frame_bytes)
            .initial_max_send_streams(self.max_concurrent_streams as usize)
            .max_send_buffer_size(self.send_buffer_bytes)
            .max_header_list_size(16 << 10)
            .max_concurrent_reset_streams(1024)
            .enable_push(false);
        b
    }
}
