//! Tunnel streams as pooled hyper connections.
//!
//! [`TunnelConnector`] is the connector of the service proxy's hyper client: a "connection" to
//! `http://<cluster>` is one tunnel stream to that cluster's agent service proxy
//! ([`Target::service_proxy`]), opened through [`Broker::dial_trusted`] (local tunnel or relay
//! peer, dial timeout, pending-dial bound, metrics). hyper keys its pool by that authority, so
//! the pool is per cluster and a warm connection serves request after request with no dial.
//!
//! The stream is bridged to hyper through an in-memory pipe of [`PIPE_BYTES`] spliced to the
//! HTTP/2 stream by the same [`splice`] every front end uses (flow control, half-close, abort),
//! its bytes charged to the cluster's CPU share like every front end's (`budget::PacedReader`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use tether_tunnel::Target;
use tether_tunnel::pump::AsyncChunkReader;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tracing::Instrument;

use crate::dial::Broker;

/// Bytes buffered between a pooled connection and its tunnel stream.
pub const PIPE_BYTES: usize = 256 * 1024;

/// Front-end label of service-proxy streams in the broker's dial and stream metrics.
pub const FRONTEND: &str = "service_proxy";

/// Opens tunnel streams to agents' service proxies for the pooled client.
#[derive(Clone)]
pub struct TunnelConnector {
    broker: Arc<Broker>,
}

impl TunnelConnector {
    pub fn new(broker: Arc<Broker>) -> Self {
        Self { broker }
    }
}

/// One pooled connection: the hyper end of the pipe to a tunnel stream.
pub struct TunnelConn {
    pipe: DuplexStream,
}

impl tower::Service<Uri> for TunnelConnector {
    type Response = TokioIo<TunnelConn>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let broker = Arc::clone(&self.broker);
        Box::pin(async move {
            let cluster = uri.host().unwrap_or_default().to_owned();
            let stream_id = broker.next_stream_id();
            let span =
                tracing::info_span!("service_proxy_stream", stream = stream_id, cluster = %cluster);
            let open = broker
                .dial_trusted(FRONTEND, &Target::service_proxy(&cluster), stream_id)
                .instrument(span.clone())
                .await
                .map_err(std::io::Error::other)?;
            let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
            tokio::spawn(
                async move {
                    let (rd, wr) = tokio::io::split(theirs);
                    let rd = AsyncChunkReader::new(rd, broker.settings.read_chunk_bytes);
                    let _ = broker.splice_paced(open, rd, wr).await;
                }
                .instrument(span),
            );
            Ok(TokioIo::new(TunnelConn { pipe: ours }))
        })
    }
}

impl Connection for TunnelConn {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for TunnelConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().pipe).poll_read(cx, buf)
    }
}

impl AsyncWrite for TunnelConn {
    tether_tunnel::forward_writes!(pipe);
}
