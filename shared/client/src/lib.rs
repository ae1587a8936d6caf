//! Rust client for the tunnel-broker's native gRPC Dial API.
//!
//! - [`Dialer`]: one gRPC channel (HTTP/2, TLS) to a broker; [`Dialer::dial`] opens a TCP
//!   connection to a target inside a managed cluster and returns a [`DialStream`] that
//!   implements `AsyncRead + AsyncWrite`. Many streams share the channel.
//! - [`Dialer::kube_client`]: a `kube::Client` for a cluster whose every connection goes
//!   through the tunnel to that cluster's API server (TLS to the API server end to end, with
//!   the kubeconfig's CA and credentials).
//!
//! Semantics: `shutdown()` on a [`DialStream`] half-closes (the target sees EOF, its reply still
//! arrives); a stream that breaks yields an `io::Error` (`ConnectionReset`), never a clean EOF;
//! dropping a stream without shutdown aborts it: an `abort` frame goes to the broker, which
//! resets the target's connection (ending the request stream would read as EOF there).

#![forbid(unsafe_code)]

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures::Stream;
use tether_proto::tunnel::v1 as pb;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Frames queued towards the broker per stream before writes wait.
pub const SEND_QUEUE_FRAMES: usize = 8;
/// Largest data frame sent.
pub const MAX_FRAME_BYTES: usize = 256 * 1024;

/// How long a stream dropped after `shutdown()` (before the target's EOF) keeps its call open
/// so that everything written before `shutdown()` still reaches the target.
pub const LINGER_AFTER_SHUTDOWN: Duration = Duration::from_secs(30);

/// A bearer token. `Debug` never shows it.
#[derive(Clone)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Client certificate and key in PEM. `Debug` never shows the key.
#[derive(Clone)]
pub struct ClientCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for ClientCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientCert(<redacted>)")
    }
}

/// How to reach a broker.
#[derive(Debug, Clone)]
pub struct DialerConfig {
    /// `https://host:port` of the broker's client TLS listener.
    pub endpoint: String,
    /// Name expected in the broker's certificate.
    pub server_name: String,
    /// CA bundle (PEM) that signed the broker's certificate.
    pub ca_pem: String,
    pub client_cert: Option<ClientCert>,
    pub token: Option<Token>,
    pub connect_timeout: Duration,
}

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid broker endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("cannot connect to broker: {0}")]
    Connect(String),
    #[error("token is not a valid header value")]
    BadToken,
    #[error("broker refused the dial ({code:?}): {message}")]
    Dial {
        code: pb::DialErrorCode,
        message: String,
    },
    #[error("broker rejected the request: {0}")]
    Status(#[from] tonic::Status),
    #[error("broker ended the stream before answering the dial")]
    NoAnswer,
    #[error("kube client: {0}")]
    Kube(String),
}

/// A connection to a broker's native Dial API.
#[derive(Clone)]
pub struct Dialer {
    client: pb::dialer_client::DialerClient<Channel>,
    token: Option<MetadataValue<Ascii>>,
}

impl Dialer {
    /// Connects (TLS, HTTP/2) to the broker.
    pub async fn connect(cfg: DialerConfig) -> Result<Self, ClientError> {
        let endpoint_err = |reason: String| ClientError::Endpoint {
            endpoint: cfg.endpoint.clone(),
            reason,
        };
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&cfg.ca_pem))
            .domain_name(cfg.server_name.clone());
        if let Some(c) = &cfg.client_cert {
            tls = tls.identity(Identity::from_pem(&c.cert_pem, &c.key_pem));
        }
        let channel = Endpoint::from_shared(cfg.endpoint.clone())
            .map_err(|e| endpoint_err(e.to_string()))?
            .tls_config(tls)
            .map_err(|e| endpoint_err(e.to_string()))?
            .connect_timeout(cfg.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size((1 << 31) - 1)
            .connect()
            .await
            .map_err(|e| {
                ClientError::Connect(format!("{e}: {:?}", std::error::Error::source(&e)))
            })?;
        let token = match &cfg.token {
            Some(t) => Some(
                format!("Bearer {}", t.0)
                    .parse()
                    .map_err(|_| ClientError::BadToken)?,
            ),
            None => None,
        };
        Ok(Self {
            client: pb::dialer_client::DialerClient::new(channel)
                .max_decoding_message_size(4 * MAX_FRAME_BYTES),
            token,
        })
    }

    /// Opens a connection to `host:port` inside `cluster` (empty host: the API server).
    pub async fn dial(
        &self,
        cluster: &str,
        host: &str,
        port: u16,
    ) -> Result<DialStream, ClientError> {
        let (tx, rx) = mpsc::channel(SEND_QUEUE_FRAMES);
        tx.try_send(pb::DialFrame {
            kind: Some(pb::dial_frame::Kind::Dial(pb::DialRequest {
                cluster: cluster.to_owned(),
                host: host.to_owned(),
                port: port.into(),
                timeout_ms: 0,
            })),
        })
        .expect("fresh channel has room");
        let (abort_tx, abort_rx) = tokio::sync::oneshot::channel();
        let mut req = tonic::Request::new(RequestFrames {
            frames: tokio_stream::wrappers::ReceiverStream::new(rx),
            abort: Some(abort_rx),
            aborted: false,
        });
        if let Some(t) = &self.token {
            req.metadata_mut().insert("authorization", t.clone());
        }
        let mut inbound = self.client.clone().dial(req).await?.into_inner();
        let first = inbound.message().await?.ok_or(ClientError::NoAnswer)?;
        let Some(pb::dial_frame::Kind::Result(result)) = first.kind else {
            return Err(ClientError::NoAnswer);
        };
        if !result.ok {
            return Err(ClientError::Dial {
                code: result.code(),
                message: result.message,
            });
        }
        Ok(DialStream {
            abort: Some(abort_tx),
            tx: PollSender::new(tx),
            rx: Some(inbound),
            pending: Bytes::new(),
            eof: false,
            stream_id: result.stream_id,
            tunnel_rtt: (result.tunnel_rtt_micros > 0)
                .then(|| Duration::from_micros(result.tunnel_rtt_micros)),
        })
    }

    /// Opens a connection to `cluster`'s API server.
    pub async fn dial_api_server(&self, cluster: &str) -> Result<DialStream, ClientError> {
        self.dial(cluster, "", 0).await
    }

    /// A `kube::Client` for `cluster`, with TLS, CA and credentials from `config` (the
    /// cluster's kubeconfig), whose connections all go through the tunnel.
    pub fn kube_client(
        &self,
        cluster: &str,
        config: kube::Config,
    ) -> Result<kube::Client, ClientError> {
        use kube::client::ConfigExt as _;
        let kube_err = |e: kube::Error| ClientError::Kube(e.to_string());
        let connector = TunnelConnector {
            dialer: self.clone(),
            cluster: cluster.to_owned(),
        };
        let https = config
            .rustls_https_connector_with_connector(connector)
            .map_err(kube_err)?;
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build::<_, kube::client::Body>(https);
        let service = tower::ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(config.auth_layer().map_err(kube_err)?)
            .map_err(
                |e: hyper_util::client::legacy::Error| -> Box<dyn std::error::Error + Send + Sync> {
                    Box::new(e)
                },
            )
            .service(http);
        Ok(kube::Client::new(service, config.default_namespace))
    }
}

/// A hyper connector that opens every connection as a tunnel stream to one cluster's API server.
#[derive(Clone)]
struct TunnelConnector {
    dialer: Dialer,
    cluster: String,
}

impl tower::Service<http::Uri> for TunnelConnector {
    type Response = hyper_util::rt::TokioIo<DialStream>;
    type Error = ClientError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ClientError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ClientError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let dialer = self.dialer.clone();
        let cluster = self.cluster.clone();
        Box::pin(async move {
            Ok(hyper_util::rt::TokioIo::new(
                dialer.dial_api_server(&cluster).await?,
            ))
        })
    }
}

/// The request side of a dial: queued frames, unless the stream is dropped without shutdown —
/// then one `abort` frame, and the request stays open so that nothing reads as a half-close.
struct RequestFrames {
    frames: tokio_stream::wrappers::ReceiverStream<pb::DialFrame>,
    /// Fires on drop without shutdown; dropped unfired by `shutdown()`.
    abort: Option<tokio::sync::oneshot::Receiver<()>>,
    aborted: bool,
}

impl Stream for RequestFrames {
    type Item = pb::DialFrame;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<pb::DialFrame>> {
        if self.aborted {
            return Poll::Pending; // the broker resets the call
        }
        if let Some(rx) = self.abort.as_mut() {
            match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(())) => {
                    self.aborted = true;
                    self.abort = None;
                    return Poll::Ready(Some(pb::DialFrame {
                        kind: Some(pb::dial_frame::Kind::Abort(pb::Abort {
                            reason: "client dropped the stream".into(),
                        })),
                    }));
                }
                Poll::Ready(Err(_)) => self.abort = None, // shut down gracefully
                Poll::Pending => {}
            }
        }
        Pin::new(&mut self.frames).poll_next(cx)
    }
}

/// One tunnelled TCP connection.
pub struct DialStream {
    /// Fired on drop without shutdown (see [`RequestFrames`]).
    abort: Option<tokio::sync::oneshot::Sender<()>>,
    tx: PollSender<pb::DialFrame>,
    /// The response stream; taken only by `Drop`.
    rx: Option<tonic::Streaming<pb::DialFrame>>,
    pending: Bytes,
    eof: bool,
    stream_id: u64,
    tunnel_rtt: Option<Duration>,
}

impl DialStream {
    /// The broker's last measured round trip of the tunnel carrying this stream.
    pub fn tunnel_rtt(&self) -> Option<Duration> {
        self.tunnel_rtt
    }

    /// The broker's id for this stream (appears in its logs and traces).
    pub fn stream_id(&self) -> u64 {
        self.stream_id
    }
}

impl hyper_util::client::legacy::connect::Connection for DialStream {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        hyper_util::client::legacy::connect::Connected::new()
    }
}

impl AsyncRead for DialStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                buf.put_slice(&self.pending[..n]);
                self.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            if self.eof {
                return Poll::Ready(Ok(()));
            }
            let Some(rx) = self.rx.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            match ready!(Pin::new(rx).poll_next(cx)) {
                Some(Ok(pb::DialFrame {
                    kind: Some(pb::dial_frame::Kind::Data(b)),
                })) => self.pending = b,
                Some(Ok(_)) => {}
                Some(Err(status)) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("tunnel stream aborted: {}", status.message()),
                    )));
                }
                None => self.eof = true,
            }
        }
    }
}

impl AsyncWrite for DialStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.tx.poll_reserve(cx))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "stream closed"))?;
        let n = buf.len().min(MAX_FRAME_BYTES);
        let frame = pb::DialFrame {
            kind: Some(pb::dial_frame::Kind::Data(Bytes::copy_from_slice(
                &buf[..n],
            ))),
        };
        self.tx
            .send_item(frame)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "stream closed"))?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.abort = None; // a graceful end, not an abort
        self.tx.close();
        Poll::Ready(Ok(()))
    }
}

impl Drop for DialStream {
    fn drop(&mut self) {
        if self.eof {
            return;
        }
        if let Some(abort) = self.abort.take() {
            let _ = abort.send(());
            return;
        }
        // Shut down gracefully but dropped before the target's EOF: dropping the response
        // stream now would cancel the call and the frames still queued (written before
        // `shutdown()`) would never reach the target. Read on, discarding, until the broker
        // ends the call, for at most `LINGER_AFTER_SHUTDOWN`.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        rt.spawn(async move {
            let _ = tokio::time::timeout(LINGER_AFTER_SHUTDOWN, async {
                while let Ok(Some(_)) = rx.message().await {}
            })
            .await;
        });
    }
}
