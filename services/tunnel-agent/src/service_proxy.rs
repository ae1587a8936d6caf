//! The agent end of the HTTP service proxy (docs/service-proxy.md).
//!
//! A broker opens a tunnel stream with `tether-target: tether-service-proxy:0` and speaks
//! HTTP/1.1 on it (several requests per stream, kept alive in the broker's pool). Each request
//! carries `tether-upstream` (`apiserver`, or `http(s)://<svc>.<ns>.svc:<port>`) and, for hub
//! identities, `tether-credentials: agent`. This module serves that HTTP and re-originates every
//! request over a pooled hyper client:
//!
//! - to the API server with TLS verified against `apiserver_ca` (ALPN `h2`, `http/1.1`: HTTP/2
//!   when it speaks it; upgrades always over HTTP/1.1);
//! - `tether-credentials: agent` replaces `Authorization` with the add-on's own token
//!   (`token_file`) — the managed side's credential never leaves the cluster; the broker set
//!   `Impersonate-User`/`Impersonate-Group` and removed every client `Impersonate-*` header;
//! - services are checked against the agent's target `policy` like any dial.
//!
//! The broker's stream is served by hyper directly ([`tether_tunnel::stream_io::StreamIo`], no
//! pipe in between); a write to an upstream that makes no progress for
//! `tunnel.write_stall_timeout` fails its connection ([`tether_tunnel::stall`]).
//!
//! Layout: [`ServiceProxy`] (built from [`ServiceProxySettings`]), [`Upstream`] (the TLS or
//! plain connection with its write-stall guard, and its hyper `Connection` facts),
//! [`UpstreamConnector`] (dial + TLS).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{AUTHORIZATION, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tether_tunnel::http_proxy;
use tether_tunnel::stall::WriteStallGuard;
use tether_tunnel::wire;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::config::{ServiceProxySettings, TargetPolicy};

/// How long a read token stays cached (projected service-account tokens rotate).
pub const TOKEN_REFRESH: Duration = Duration::from_secs(60);
/// Idle pooled upstream connections are closed after this.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Idle pooled upstream connections kept per host.
pub const POOL_MAX_IDLE_PER_HOST: usize = 32;
/// The largest HTTP/2 frame the agent accepts from an upstream (`SETTINGS_MAX_FRAME_SIZE`).
/// HTTP/2's default, 16 KiB, makes a large response (a LIST) a frame, a parse and a body
/// chunk per 16 KiB on both ends; servers that honour the setting (Go's, the API server's)
/// send up to this much per frame.
pub const UPSTREAM_H2_MAX_FRAME_BYTES: u32 = 256 << 10;
/// Budget of one upstream dial + TLS handshake.
pub const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

type Body = BoxBody<Bytes, hyper::Error>;

#[derive(Debug, thiserror::Error)]
pub enum ServiceProxyError {
    #[error("service_proxy.{field} {path}: {source}")]
    Ca {
        field: &'static str,
        path: String,
        source: tether_tls::TlsError,
    },
}

/// The agent's service proxy, shared by all tunnels.
pub struct ServiceProxy {
    cluster: String,
    apiserver: String,
    client: Client<UpstreamConnector, Incoming>,
    upgrade_client: Client<UpstreamConnector, Incoming>,
    token_file: Option<std::path::PathBuf>,
    token: Mutex<Option<(Instant, HeaderValue)>>,
    policy: TargetPolicy,
    max_header_bytes: usize,
}

impl ServiceProxy {
    pub fn new(
        cluster: &str,
        apiserver: &str,
        policy: &TargetPolicy,
        s: &ServiceProxySettings,
        write_stall_timeout: Duration,
    ) -> Result<Self, ServiceProxyError> {
        let roots = |field, path: &std::path::Path| {
            tether_tls::reload::load_roots(path)
                .map(Arc::new)
                .map_err(|source| ServiceProxyError::Ca {
                    field,
                    path: path.display().to_string(),
                    source,
                })
        };
        let api_roots = roots("apiserver_ca", &s.apiserver_ca)?;
        let svc_roots = match &s.services_ca {
            Some(p) => roots("services_ca", p)?,
            None => Arc::clone(&api_roots),
        };
        let tls = |alpn: &[&[u8]]| {
            let mk = |r: &Arc<rustls::RootCertStore>| {
                let mut c = tether_tls::client_config_builder()
                    .with_root_certificates(Arc::clone(r))
                    .with_no_client_auth();
                c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
                Arc::new(c)
            };
            (mk(&api_roots), mk(&svc_roots))
        };
        let connector = |alpn: &[&[u8]]| {
            let (api, svc) = tls(alpn);
            UpstreamConnector(Arc::new(ConnectorInner {
                apiserver: apiserver.to_owned(),
                apiserver_name: s.apiserver_server_name.clone(),
                api_tls: TlsConnector::from(api),
                svc_tls: TlsConnector::from(svc),
                addresses: s.service_addresses.clone(),
                write_stall_timeout,
            }))
        };
        let build = |c: UpstreamConnector| {
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
                .http2_max_frame_size(UPSTREAM_H2_MAX_FRAME_BYTES)
                .build(c)
        };
        Ok(Self {
            cluster: cluster.to_owned(),
            apiserver: apiserver.to_owned(),
            client: build(connector(&[b"h2", b"http/1.1"])),
            upgrade_client: build(connector(&[b"http/1.1"])),
            token_file: s.token_file.clone(),
            token: Mutex::new(None),
            policy: policy.clone(),
            max_header_bytes: s.max_header_bytes,
        })
    }

    /// Serves the broker's HTTP/1.1 on one tunnel stream until the broker closes it.
    pub async fn serve<IO>(self: Arc<Self>, io: IO)
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let max_head = self.max_header_bytes;
        let svc = hyper::service::service_fn(move |req| {
            let me = Arc::clone(&self);
            async move { Ok::<_, Infallible>(me.handle(req).await) }
        });
        let r = hyper::server::conn::http1::Builder::new()
            .max_buf_size(max_head)
            .serve_connection(TokioIo::new(io), svc)
            .with_upgrades()
            .await;
        if let Err(e) = r {
            tracing::debug!(error = %e, "service-proxy stream ended with an error");
        }
    }

    async fn handle(&self, mut req: Request<Incoming>) -> Response<Body> {
        match self.prepare(&mut req) {
            Ok(()) => {}
            Err((status, msg)) => return text(status, msg),
        }
        match http_proxy::forward(&self.client, &self.upgrade_client, req).await {
            Ok(mut resp) => {
                http_proxy::strip_hop_by_hop(resp.headers_mut());
                resp.map(|b| b.boxed())
            }
            Err(e) => {
                tracing::info!(error = %e, "service-proxy upstream request failed");
                text(
                    StatusCode::BAD_GATEWAY,
                    format!("cluster {}: upstream request failed: {e}", self.cluster),
                )
            }
        }
    }

    /// Rewrites the broker's request for its upstream: absolute URI, credentials, no tether
    /// or hop-by-hop headers.
    fn prepare(&self, req: &mut Request<Incoming>) -> Result<(), (StatusCode, String)> {
        let bad = |m: String| (StatusCode::BAD_REQUEST, m);
        let h = req.headers();
        let upstream = h
            .get(wire::HEADER_UPSTREAM)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| bad(format!("missing {}", wire::HEADER_UPSTREAM)))?
            .to_owned();
        let agent_creds = h
            .get(wire::HEADER_CREDENTIALS)
            .is_some_and(|v| v.as_bytes() == b"agent");
        let base = if upstream == wire::APISERVER_DEST {
            format!("https://{}", self.apiserver)
        } else {
            let uri: Uri = upstream
                .parse()
                .map_err(|_| bad(format!("bad {} {upstream:?}", wire::HEADER_UPSTREAM)))?;
            let (Some(host), Some(port)) = (uri.host(), uri.port_u16()) else {
                return Err(bad(format!("{upstream:?} has no host:port")));
            };
            if !self.policy.permits(host, port) {
                return Err((
                    StatusCode::FORBIDDEN,
                    format!(
                        "agent policy of cluster {} forbids {host}:{port}",
                        self.cluster
                    ),
                ));
            }
            upstream.trim_end_matches('/').to_owned()
        };
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        *req.uri_mut() = format!("{base}{pq}")
            .parse()
            .map_err(|_| bad(format!("bad request path {pq:?}")))?;
        let headers = req.headers_mut();
        headers.remove(wire::HEADER_UPSTREAM);
        headers.remove(wire::HEADER_CREDENTIALS);
        headers.remove(http::header::HOST);
        http_proxy::strip_hop_by_hop(headers);
        if agent_creds {
            let token = self
                .token()
                .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
            headers.insert(AUTHORIZATION, token);
        }
        Ok(())
    }

    /// `Bearer <token_file>`, re-read after [`TOKEN_REFRESH`].
    fn token(&self) -> Result<HeaderValue, TokenError> {
        let Some(path) = &self.token_file else {
            return Err(TokenError::NoTokenFile {
                cluster: self.cluster.clone(),
            });
        };
        let mut cached = self.token.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, v)) = cached.as_ref()
            && at.elapsed() < TOKEN_REFRESH
        {
            return Ok(v.clone());
        }
        let t = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.clone(),
            source,
        })?;
        let mut v = HeaderValue::from_str(&format!("Bearer {}", t.trim()))
            .map_err(|_| TokenError::NotAToken { path: path.clone() })?;
        v.set_sensitive(true);
        *cached = Some((Instant::now(), v.clone()));
        Ok(v)
    }
}

fn text(status: StatusCode, msg: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("{msg}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

struct ConnectorInner {
    apiserver: String,
    apiserver_name: String,
    api_tls: TlsConnector,
    svc_tls: TlsConnector,
    addresses: std::collections::BTreeMap<String, String>,
    /// A write to the upstream that makes no progress this long fails its connection.
    write_stall_timeout: Duration,
}

/// Dials upstreams for the pooled client: the API server (TLS name `apiserver_server_name`)
/// or a service (`service_addresses` override, else DNS; TLS name = the service host).
#[derive(Clone)]
pub struct UpstreamConnector(Arc<ConnectorInner>);

/// A connection to an upstream, plain or TLS. An upstream that stops reading while a write
/// (a request body) waits fails the connection after `tunnel.write_stall_timeout`, and with it
/// the tunnel stream it holds.
pub struct Upstream {
    io: WriteStallGuard<UpstreamStream>,
}

/// The socket of an [`Upstream`].
pub enum UpstreamStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl tower_service::Service<Uri> for UpstreamConnector {
    type Response = TokioIo<Upstream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move {
            let io_err = |m: String| std::io::Error::other(m);
            let host = uri.host().unwrap_or_default().to_owned();
            let tls = uri.scheme_str() == Some("https");
            let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
            let authority = format!("{host}:{port}");
            let (dial, name, connector) = if authority == inner.apiserver {
                (authority, inner.apiserver_name.clone(), &inner.api_tls)
            } else {
                let dial = inner
                    .addresses
                    .get(&authority)
                    .cloned()
                    .unwrap_or(authority);
                (dial, host, &inner.svc_tls)
            };
            let work = async {
                let tcp = TcpStream::connect(&dial)
                    .await
                    .map_err(|e| io_err(format!("dial {dial}: {e}")))?;
                let _ = tcp.set_nodelay(true);
                if !tls {
                    return Ok::<_, std::io::Error>(UpstreamStream::Plain(tcp));
                }
                let sni = ServerName::try_from(name.clone())
                    .map_err(|_| io_err(format!("bad TLS name {name:?}")))?;
                let mut s = connector
                    .connect(sni, tcp)
                    .await
                    .map_err(|e| io_err(format!("TLS to {dial} (name {name}): {e}")))?;
                // Large writes (an upload's body) go to the socket whole, not in rustls's
                // 64 KiB pieces: with its default limit a sender spends 1.2–1.3× the CPU per GB
                // (`tether-tls-cost`, docs/benchmarks.md), as the tunnel's and the SDK's
                // connections no longer do.
                s.get_mut()
                    .1
                    .set_buffer_limit(Some(tether_tunnel::settings::DEFAULT_TLS_SEND_BUFFER));
                Ok(UpstreamStream::Tls(Box::new(s)))
            };
            let stream = tokio::time::timeout(UPSTREAM_CONNECT_TIMEOUT, work)
                .await
                .map_err(|_| io_err(format!("connect to {dial} timed out")))??;
            Ok(TokioIo::new(Upstream {
                io: WriteStallGuard::new(stream, inner.write_stall_timeout),
            }))
        })
    }
}

impl Connection for Upstream {
    fn connected(&self) -> Connected {
        match self.io.get_ref() {
            UpstreamStream::Tls(s) if s.get_ref().1.alpn_protocol() == Some(b"h2") => {
                Connected::new().negotiated_h2()
            }
            _ => Connected::new(),
        }
    }
}

impl AsyncRead for Upstream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Upstream {
    tether_tunnel::forward_writes!(io);
}

impl AsyncRead for UpstreamStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpstreamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Why the agent's own credential cannot be sent (answered to the broker as a 502).
#[derive(Debug, thiserror::Error)]
enum TokenError {
    #[error(
        "the agent of cluster {cluster} has no service_proxy.token_file: hub identities cannot be impersonated (use a token of the cluster instead)"
    )]
    NoTokenFile { cluster: String },
    #[error("agent token file {}: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("agent token file {} is not a token", path.display())]
    NotAToken { path: std::path::PathBuf },
}
