//! Tunnel streams as pooled hyper connections.
//!
//! [`TunnelConnector`] is the connector of the service proxy's hyper client: a "connection" to
//! `http://<cluster>` is one tunnel stream to that cluster's agent service proxy
//! ([`Target::service_proxy`]), opened through [`Broker::dial_trusted`] (local tunnel or relay
//! peer, dial timeout, pending-dial bound, metrics). hyper keys its pool by that authority, so
//! the pool is per cluster and a warm connection serves request after request with no dial.
//!
//! hyper reads and writes the stream itself ([`StreamIo`]: no pipe and no splice task in
//! between, so a response body is copied once out of the stream's chunks into hyper's buffer).
//! Both directions are charged to the stream's share of the broker's CPU (`budget::PollPacer`,
//! as every front end's bytes), and the stream's end is recorded like any other front end's
//! ([`Broker::finish`]) when hyper drops the connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use tether_tunnel::Target;
use tether_tunnel::pump::SpliceError;
use tether_tunnel::stream_io::StreamIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tracing::Instrument;

use crate::budget::PollPacer;
use crate::dial::{Broker, StreamTicket};

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

/// One pooled connection: a tunnel stream, paced, recorded when dropped.
pub struct TunnelConn {
    io: StreamIo,
    read_pace: PollPacer,
    write_pace: PollPacer,
    ticket: Option<StreamTicket>,
    broker: Arc<Broker>,
    span: tracing::Span,
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
            let pacer = open.ticket.pacer.clone();
            Ok(TokioIo::new(TunnelConn {
                io: StreamIo::new(open.send, open.recv, broker.counters.clone()),
                read_pace: PollPacer::new(pacer.clone()),
                write_pace: PollPacer::new(pacer),
                ticket: Some(open.ticket),
                broker,
                span,
            }))
        })
    }
}

impl Drop for TunnelConn {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let _enter = self.span.enter();
            let stats = self.io.stats();
            let result = self
                .io
                .outcome()
                .map(|()| stats.clone())
                .map_err(|reason| SpliceError { reason, stats });
            self.broker.finish(&ticket, &result);
        }
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
        let me = self.get_mut();
        ready!(me.read_pace.poll_ready(cx));
        let before = buf.filled().len();
        ready!(Pin::new(&mut me.io).poll_read(cx, buf))?;
        me.read_pace.charge(buf.filled().len() - before);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for TunnelConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_write_vectored(cx, &[std::io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        ready!(me.write_pace.poll_ready(cx));
        let n = ready!(Pin::new(&mut me.io).poll_write_vectored(cx, bufs))?;
        me.write_pace.charge(n);
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
