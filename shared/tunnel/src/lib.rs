//! The broker↔agent tunnel protocol.
//!
//! One mTLS connection per agent–broker pair. The agent dials out; the broker opens **one stream
//! per tunnelled TCP connection** on it — with `tether-tunnel/2` ([`mux`]), or with HTTP/2
//! (`tether-tunnel/1`: the agent serves HTTP/2, the broker is the client) when either side lacks
//! `/2`. Bytes travel as raw DATA frames (no gRPC message framing, no extra copy), and flow
//! control gives every TCP connection its own window:
//!
//! - a stalled reader only stops its own stream (its window fills), never the tunnel;
//! - half-close is END_STREAM, an abort is RST_STREAM — a peer never mistakes a broken
//!   connection for a clean EOF (the TCP side of an aborted stream is closed with RST).
//!
//! Layout:
//! - [`address`]: how clients name a cluster and a target (`<cluster>:443` is the API server,
//!   `<host>.<cluster>.tether:<port>` anything else), parsed with errors that say what is wrong.
//! - [`wire`]: paths and headers of tunnel requests, dial error codes and their HTTP statuses.
//! - [`settings`]: HTTP/2 window, frame and keepalive settings, applied to both ends.
//! - [`mux`]: `tether-tunnel/2`, Tether's own broker↔agent multiplexer (one task per hop on the
//!   send path), negotiated by ALPN before `tether-tunnel/1` (HTTP/2).
//! - [`stream`]: a tunnel stream's two halves whatever carries them (HTTP/2 or `mux`).
//! - [`stream_io`]: a tunnel stream as `AsyncRead + AsyncWrite`, for a protocol spoken on the
//!   stream itself (the service proxy's HTTP/1.1 on broker and agent).
//! - [`stall`]: a write-progress timeout for a socket handed to a protocol library.
//! - [`abort`]: why a stream was aborted.
//! - [`pump`]: copying between a socket and a tunnel stream with bounded buffers, half-close,
//!   abort propagation and a write-progress timeout.
//! - [`readahead`]: a read-ahead buffer below TLS that exists only while data flows.
//! - [`lingering`]: a closing end reads until the peer's EOF, so its close is never a reset
//!   that destroys the bytes it sent last.
//! - [`keepalive`]: HTTP/2 PING liveness checks (and the adaptive window's BDP samples).
//! - [`forward_writes!`]: the write pass-through of transport wrappers.
//! - [`http_proxy`]: hop-by-hop headers and upgrade-aware forwarding for the HTTP service
//!   proxy (broker and agent ends).
//! - [`watchdog`]: the wedged-tunnel watchdog (no bytes from the peer while bytes wait for an
//!   answer: torn down and redialled).
//! - [`window`]: adaptive receive windows sized to the tunnel's bandwidth × round trip.
//! - [`pause`]: the keepalive's and watchdog's clocks count only time this process ran (a
//!   paused VM or process does not blame its peers for the pause).

pub mod abort;
pub mod address;
mod forward;
pub mod http_proxy;
pub mod keepalive;
pub mod lingering;
pub mod mux;
pub mod pattern;
pub mod pause;
pub mod pump;
pub mod readahead;
pub mod relay;
pub mod settings;
pub mod stall;
pub mod stream;
pub mod stream_io;
pub mod watchdog;
pub mod window;
pub mod wire;

pub use address::{AddressError, Dest, Target};
pub use settings::TunnelSettings;
pub use stream::{StreamRx, StreamTx};
pub use wire::{DialError, DialErrorKind};

#[doc(hidden)]
pub use tokio as __tokio;

/// Helpers shared by this crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use tokio::net::{TcpListener, TcpStream};

    /// Two ends of a real loopback TCP connection (port 0).
    pub async fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }
}
