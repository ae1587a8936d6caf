//! The HTTP client connections' part of a drain.
//!
//! When the broker starts to drain (SIGTERM), every client connection that can carry more
//! requests is told to take them elsewhere, so a client with a long-lived connection moves to
//! another broker at once instead of sending its next dials to one that is going away:
//!
//! - `tether-dial/1` connections get the mux's `GOAWAY` (`client_mux`);
//! - HTTP/2 connections (the gRPC `Dial`, `DialRaw`, konnectivity's `Proxy`, the service proxy
//!   over h2) get hyper's graceful shutdown through [`serve_until_drained`]: a `GOAWAY` with the
//!   last stream the broker took, after which the client opens new streams on a new connection;
//! - HTTP/1.1 service-proxy connections are closed once the request in flight (if any) has
//!   been answered (`connection: close`), an idle keep-alive connection at once.
//!
//! Streams and requests already taken finish within the drain grace, as before.

use std::pin::Pin;

use tokio_util::sync::CancellationToken;

/// Drives `conn` (a hyper server connection) to its end; once `draining` is cancelled it calls
/// `graceful` on it (its `graceful_shutdown`) and keeps driving it until the requests it had
/// taken are answered.
///
/// The connection is boxed: a hyper connection's state is large (over 1.5 KiB), and the future
/// of every plain-port connection — most of them idle CONNECT streams — is as large as its
/// largest branch, the h2c one included. Boxed, only HTTP/2 connections pay for it (measured:
/// broker RSS per idle CONNECT stream 7.1 KiB with the connection inline and held twice, as an
/// `async fn` keeps its arguments beside its locals).
pub async fn serve_until_drained<C, E>(
    mut conn: Pin<Box<C>>,
    draining: &CancellationToken,
    graceful: impl FnOnce(Pin<&mut C>),
) -> Result<(), E>
where
    C: Future<Output = Result<(), E>>,
{
    tokio::select! {
        r = conn.as_mut() => return r,
        () = draining.cancelled() => {}
    }
    graceful(conn.as_mut());
    conn.await
}
