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
//! A stream that reaches an HTTP/2 connection after the drain began is refused unprocessed
//! ([`refuse_if_draining`]: `RST_STREAM REFUSED_STREAM`): hyper's first GOAWAY still admits
//! streams for a round trip, and a client may have sent a request before it read the GOAWAY;
//! served, such a dial would find the agents already gone to other brokers (`no_tunnel`).
//! Refused, it is retried on a new connection by the SDK, gRPC and HTTP/2 clients, as HTTP/2
//! allows for a stream the server did not process.
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
/// `Err(REFUSED_STREAM)` for an HTTP/2 request that arrives once the drain has begun (see the
/// module docs); returned as the hyper service's error, it makes hyper reset the stream with
/// that reason. HTTP/1.1 requests are served: HTTP/1.1 has no way to refuse one unprocessed,
/// and its connection closes after the answer.
pub fn refuse_if_draining(
    draining: &CancellationToken,
    version: http::Version,
) -> Result<(), h2::Error> {
    if version == http::Version::HTTP_2 && draining.is_cancelled() {
        tracing::debug!("HTTP/2 stream refused unprocessed: the broker is draining");
        return Err(h2::Reason::REFUSED_STREAM.into());
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Empty, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    use super::*;

    /// A hyper server whose service refuses through [`refuse_if_draining`], on one end of an
    /// in-memory pipe; the other end is returned.
    fn serve(draining: CancellationToken) -> tokio::io::DuplexStream {
        let (client, server) = tokio::io::duplex(64 << 10);
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let draining = draining.clone();
            async move {
                refuse_if_draining(&draining, req.version())?;
                Ok::<_, h2::Error>(http::Response::new(Full::new(Bytes::from_static(
                    b"served",
                ))))
            }
        });
        tokio::spawn(async move {
            let b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            b.serve_connection(TokioIo::new(server), svc).await
        });
        client
    }

    /// The refusal reaches an HTTP/2 client as `RST_STREAM REFUSED_STREAM` (hyper resets the
    /// stream with the reason found in the service's error), which clients retry elsewhere;
    /// before the drain the same request is served, and an HTTP/1.1 request is served during it.
    #[tokio::test]
    async fn an_http2_stream_that_arrives_while_draining_is_refused_unprocessed() {
        let draining = CancellationToken::new();
        for drain in [false, true] {
            if drain {
                draining.cancel();
            }
            let (mut send, conn) = h2::client::handshake(serve(draining.clone()))
                .await
                .unwrap();
            tokio::spawn(conn);
            let req = http::Request::post("http://broker/tether.tunnel.v1.Dialer/DialRaw")
                .body(())
                .unwrap();
            let (resp, _body) = send.send_request(req, true).unwrap();
            match resp.await {
                Ok(r) if !drain => assert_eq!(r.status(), http::StatusCode::OK),
                Err(e) if drain => assert_eq!(
                    e.reason(),
                    Some(h2::Reason::REFUSED_STREAM),
                    "refused unprocessed, so the client may retry: {e}"
                ),
                other => panic!("draining {drain}: unexpected answer {other:?}"),
            }
        }

        let io = TokioIo::new(serve(draining));
        let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        let resp = send
            .send_request(http::Request::get("/").body(Empty::<Bytes>::new()).unwrap())
            .await
            .expect("HTTP/1.1 has no unprocessed refusal: served");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"served");
    }
}
