//! The HTTP service proxy: kube clients reach any cluster by URL (docs/service-proxy.md).
//!
//! Its own TLS listener (`service_proxy.listen`, ALPN `h2` and `http/1.1`, client certificate
//! optional) serves cluster-proxy's user-server URL forms:
//!
//! | path | reaches |
//! |---|---|
//! | `/<cluster>/api/v1/namespaces/<ns>/services/<[proto:]svc:port>/proxy-service/<path>` | `<svc>.<ns>.svc:<port>` (`http` unless `proto` is `https`), if the [`allowlist`] admits it |
//! | `/<cluster>/<anything else>` | the cluster's API server, path `/<anything else>` |
//!
//! Authentication: a hub identity (client certificate `tether:client:<name>`, or a bearer token
//! of a hub client) is authorised by the broker's client policy for the cluster's API server
//! and sent as `Impersonate-User: tether:client:<name>` + `Impersonate-Group`s, with
//! `tether-credentials: agent` so the agent applies the add-on's own managed-side credential.
//! Any other bearer token is passed through to the managed API server, which authenticates it.
//! Client `Impersonate-*` headers are always removed; the request head is bounded
//! (`max_header_bytes`).
//!
//! Forwarding: one pooled HTTP/1.1 client per broker ([`pool`]); a pooled connection is a tunnel
//! stream to the agent's service proxy (`tether-service-proxy:0`), kept alive between requests,
//! so a request costs no tunnel dial and no TLS handshake once the pool is warm. A client whose
//! connection takes no bytes for `tunnel.write_stall_timeout` while a write waits is cut off
//! (`tether_tunnel::stall`). Watches stream
//! as bodies; upgrades (exec/attach/port-forward over SPDY or WebSocket) are joined end to end.
//!
//! Layout: this file (listener, routing, auth, header rewrite, metrics), [`pool`] (tunnel
//! streams as hyper connections), [`allowlist`] (default-deny service allowlist, KV watch).

pub mod allowlist;
pub mod pool;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{AUTHORIZATION, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tether_tunnel::http_proxy;
use tether_tunnel::wire::{self, DialErrorKind};
use tether_tunnel::{DialError, Target};
use tracing::Instrument;

use crate::auth::{ClientId, PeerCert};
use crate::config::ServiceProxyConfig;
use crate::dial::Broker;
use crate::metrics::BrokerMetrics;

pub use allowlist::Allowlist;

/// Time a client has to send a complete HTTP/1.1 request head.
pub const HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Impersonated user of a hub client: `tether:client:<name>` (its certificate CN).
pub const IMPERSONATE_USER_PREFIX: &str = "tether:client:";

type Body = BoxBody<Bytes, hyper::Error>;

/// A response body whose data chunks are offered to the connection's write batch before h2
/// gets them, so the batch sends h2's frames of them by reference (`batch::Payloads`).
struct LentBody {
    inner: Body,
    payloads: crate::batch::Payloads,
}

impl hyper::body::Body for LentBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(f))) = &r
            && let Some(d) = f.data_ref()
        {
            self.payloads.offer(d);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Where a request goes inside the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    ApiServer {
        path_and_query: String,
    },
    Service {
        namespace: String,
        name: String,
        https: bool,
        port: u16,
        path_and_query: String,
    },
}

/// Splits `/<cluster>/<rest>` into the cluster and its [`Route`].
pub fn route(path: &str, query: Option<&str>) -> Result<(String, Route), DialError> {
    let bad = |m: String| DialError::new(DialErrorKind::BadRequest, m);
    let rest = path.strip_prefix('/').unwrap_or(path);
    let (cluster, tail) = rest.split_once('/').unwrap_or((rest, ""));
    if cluster.is_empty() {
        return Err(bad(
            "the path must start with /<cluster>/ (e.g. /edge-1/api/v1/namespaces)".into(),
        ));
    }
    tether_tls::identity::validate_dns_label(cluster)
        .map_err(|r| bad(format!("cluster {cluster:?} in the path: {r}")))?;
    let q = query.map(|q| format!("?{q}")).unwrap_or_default();
    let parts: Vec<&str> = tail.splitn(8, '/').collect();
    if let [
        "api",
        "v1",
        "namespaces",
        ns,
        "services",
        spec,
        "proxy-service",
        ..,
    ] = parts[..]
    {
        let sub = parts.get(7).copied().unwrap_or("");
        let (proto, svc_port) = match spec.split_once(':') {
            Some((p @ ("http" | "https"), r)) if r.contains(':') => (p, r),
            _ => ("http", spec),
        };
        let (name, port) = svc_port
            .rsplit_once(':')
            .and_then(|(n, p)| Some((n, p.parse::<u16>().ok().filter(|p| *p != 0)?)))
            .ok_or_else(|| {
                bad(format!(
                    "service {spec:?} must be [http:|https:]<name>:<port> with a numeric port"
                ))
            })?;
        for (what, v) in [("namespace", ns), ("service", name)] {
            tether_tls::identity::validate_dns_label(v)
                .map_err(|r| bad(format!("{what} {v:?}: {r}")))?;
        }
        return Ok((
            cluster.to_owned(),
            Route::Service {
                namespace: ns.to_owned(),
                name: name.to_owned(),
                https: proto == "https",
                port,
                path_and_query: format!("/{sub}{q}"),
            },
        ));
    }
    Ok((
        cluster.to_owned(),
        Route::ApiServer {
            path_and_query: format!("/{tail}{q}"),
        },
    ))
}

/// Who sends the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A hub client: impersonated with the agent's credentials.
    Hub(ClientId),
    /// An unknown bearer token: passed through to the managed API server.
    PassThrough,
}

/// The service-proxy front end (cheap to clone).
#[derive(Clone)]
pub struct ServiceProxy {
    inner: Arc<Inner>,
}

struct Inner {
    broker: Arc<Broker>,
    cfg: ServiceProxyConfig,
    pool: Client<pool::TunnelConnector, Incoming>,
    allowlist: Arc<Allowlist>,
    metrics: BrokerMetrics,
}

impl ServiceProxy {
    pub fn new(broker: Arc<Broker>, cfg: ServiceProxyConfig, allowlist: Arc<Allowlist>) -> Self {
        let pool = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(cfg.pool_idle_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle_per_cluster)
            .http1_max_buf_size(cfg.max_header_bytes.max(8192))
            .build(pool::TunnelConnector::new(Arc::clone(&broker)));
        let metrics = broker.metrics.clone();
        Self {
            inner: Arc::new(Inner {
                broker,
                cfg,
                pool,
                allowlist,
                metrics,
            }),
        }
    }

    /// Serves one TLS connection (HTTP/1.1 or HTTP/2 by ALPN: `h2`) until it closes.
    pub async fn serve_connection<IO>(&self, io: IO, peer: Option<PeerCert>, h2: bool)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        // A client that stops reading while a response waits fails its connection after the
        // stall timeout (and with it the tunnel streams it holds), as a spliced stream would.
        let io = tether_tunnel::stall::WriteStallGuard::new(
            io,
            self.inner.broker.settings.write_stall_timeout,
        );
        if h2 {
            return self.serve_h2(io, peer).await;
        }
        let me = self.clone();
        let peer = Arc::new(peer);
        let svc = hyper::service::service_fn(move |req| {
            let me = me.clone();
            let peer = Arc::clone(&peer);
            async move {
                crate::drain::refuse_if_draining(&me.inner.broker.draining, req.version())?;
                Ok::<_, h2::Error>(me.handle(req, peer.as_ref().as_ref()).await)
            }
        });
        let max = self.inner.cfg.max_header_bytes;
        let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        b.http1()
            .max_buf_size(max.max(8192))
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT);
        b.http2()
            .max_header_list_size(u32::try_from(max).unwrap_or(u32::MAX));
        let conn = Box::pin(b.serve_connection_with_upgrades(TokioIo::new(io), svc));
        // Draining: HTTP/2 GOAWAY, HTTP/1.1 closed once the request in flight is answered.
        if let Err(e) = crate::drain::serve_until_drained(conn, &self.inner.broker.draining, |c| {
            c.graceful_shutdown()
        })
        .await
        {
            tracing::debug!(error = %e, "service-proxy connection ended with an error");
        }
    }

    /// An HTTP/2 connection (ALPN `h2`: no HTTP/1.1 upgrade can happen on it). h2 writes each
    /// DATA frame, at most the client's frame size (16 KiB for kubectl), with a write and a
    /// flush of its own: batched per poll of the connection (`batch`), a burst of frames leaves
    /// in one write, each response chunk lent to the batch (no copy).
    async fn serve_h2<IO>(&self, io: IO, peer: Option<PeerCert>)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (io, flusher) = crate::batch::batched(io);
        let payloads = flusher.payloads();
        let me = self.clone();
        let peer = Arc::new(peer);
        let svc = hyper::service::service_fn(move |req| {
            let me = me.clone();
            let peer = Arc::clone(&peer);
            let payloads = payloads.clone();
            async move {
                crate::drain::refuse_if_draining(&me.inner.broker.draining, req.version())?;
                let resp = me.handle(req, peer.as_ref().as_ref()).await;
                Ok::<_, h2::Error>(resp.map(|b| LentBody { inner: b, payloads }.boxed()))
            }
        });
        let max = self.inner.cfg.max_header_bytes;
        let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        b.max_header_list_size(u32::try_from(max).unwrap_or(u32::MAX))
            .timer(hyper_util::rt::TokioTimer::new());
        let conn = Box::pin(b.serve_connection(TokioIo::new(io), svc));
        let conn = Box::pin(crate::batch::FlushAfterPoll::new(conn, flusher));
        // Draining: GOAWAY.
        if let Err(e) = crate::drain::serve_until_drained(conn, &self.inner.broker.draining, |c| {
            c.get_mut().conn.as_mut().graceful_shutdown()
        })
        .await
        {
            tracing::debug!(error = %e, "service-proxy connection ended with an error");
        }
    }

    async fn handle(&self, req: Request<Incoming>, peer: Option<&PeerCert>) -> Response<Body> {
        let started = Instant::now();
        let stream_id = self.inner.broker.next_stream_id();
        let span = tracing::info_span!(
            "service_proxy_request",
            stream = stream_id,
            method = %req.method(),
            cluster = tracing::field::Empty,
            client = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        let (cluster_label, resp) = async {
            let (label, r) = match self.prepare(req, peer).await {
                Ok((label, req)) => {
                    let r = http_proxy::forward(&self.inner.pool, &self.inner.pool, req).await;
                    (label, r.map_err(|e| upstream_error(&e)))
                }
                Err((label, e)) => (label, Err(e)),
            };
            let resp = match r {
                Ok(mut resp) => {
                    http_proxy::strip_hop_by_hop(resp.headers_mut());
                    resp.map(|b| b.boxed())
                }
                Err(e) => {
                    self.inner.broker.record_failure(FRONTEND, &e);
                    status_response(&e)
                }
            };
            tracing::Span::current().record("status", resp.status().as_u16());
            (label, resp)
        }
        .instrument(span)
        .await;
        let code = resp.status().as_u16().to_string();
        self.inner
            .metrics
            .service_proxy_requests
            .with_label_values(&[&cluster_label, &code])
            .inc();
        self.inner
            .metrics
            .service_proxy_duration
            .with_label_values(&[&cluster_label])
            .observe(started.elapsed().as_secs_f64());
        resp
    }

    /// Authenticates, authorises and rewrites the request for the agent's service proxy.
    /// Returns the metric label of the cluster (empty until the cluster is known to be
    /// admissible, so arbitrary paths cannot grow the label set).
    async fn prepare(
        &self,
        mut req: Request<Incoming>,
        peer: Option<&PeerCert>,
    ) -> Result<(String, Request<Incoming>), (String, DialError)> {
        let unlabelled = |e| (String::new(), e);
        let (cluster, route) = route(req.uri().path(), req.uri().query()).map_err(unlabelled)?;
        tracing::Span::current().record("cluster", cluster.as_str());
        let caller = self.caller(&req, peer).map_err(unlabelled)?;
        let auth = &self.inner.broker.auth;
        match &caller {
            Caller::Hub(c) => {
                tracing::Span::current().record("client", c.name.as_str());
                auth.authorize(c, &Target::api_server(&cluster))
            }
            Caller::PassThrough => auth.clusters().check_client(&cluster),
        }
        .map_err(unlabelled)?;
        let (upstream, pq) = match &route {
            Route::ApiServer { path_and_query } => {
                (wire::APISERVER_DEST.to_owned(), path_and_query.clone())
            }
            Route::Service {
                namespace,
                name,
                https,
                port,
                path_and_query,
            } => {
                if !self
                    .inner
                    .allowlist
                    .admits(&cluster, namespace, name, *port)
                {
                    return Err((
                        cluster.clone(),
                        DialError::new(
                            DialErrorKind::Forbidden,
                            format!(
                                "service {namespace}/{name}:{port} of cluster {cluster} is not in the service proxy allowlist (ServiceProxyAllowlist; default deny)"
                            ),
                        ),
                    ));
                }
                let scheme = if *https { "https" } else { "http" };
                (
                    format!("{scheme}://{name}.{namespace}.svc:{port}"),
                    path_and_query.clone(),
                )
            }
        };
        let labelled = |e| (cluster.clone(), e);
        *req.uri_mut() = format!("http://{cluster}{pq}").parse().map_err(|_| {
            labelled(DialError::new(
                DialErrorKind::BadRequest,
                format!("bad request path {pq:?}"),
            ))
        })?;
        // The pool speaks HTTP/1.1 to the agent, whatever the client spoke.
        *req.version_mut() = http::Version::HTTP_11;
        let h = req.headers_mut();
        let stripped = strip_client_controlled(h);
        if stripped > 0 {
            self.inner
                .metrics
                .service_proxy_stripped_headers
                .inc_by(stripped);
            tracing::info!(stripped, "client Impersonate-* / tether-* headers removed");
        }
        http_proxy::strip_hop_by_hop(h);
        h.remove(http::header::HOST);
        let value = |s: &str| {
            HeaderValue::from_str(s).map_err(|_| {
                labelled(DialError::new(
                    DialErrorKind::BadRequest,
                    format!("{s:?} is not a header value"),
                ))
            })
        };
        h.insert(wire::HEADER_UPSTREAM, value(&upstream)?);
        if let Caller::Hub(_) = &caller {
            // A hub credential never leaves the hub side.
            h.remove(AUTHORIZATION);
        }
        // The agent's own credential goes to the API server only, never to a service.
        if let (Caller::Hub(c), Route::ApiServer { .. }) = (&caller, &route) {
            h.insert(wire::HEADER_CREDENTIALS, HeaderValue::from_static("agent"));
            h.insert(
                "impersonate-user",
                value(&format!("{IMPERSONATE_USER_PREFIX}{}", c.name))?,
            );
            for g in &self.inner.cfg.impersonate_groups {
                h.append("impersonate-group", value(g)?);
            }
        }
        Ok((cluster, req))
    }

    fn caller(
        &self,
        req: &Request<Incoming>,
        peer: Option<&PeerCert>,
    ) -> Result<Caller, DialError> {
        let auth = &self.inner.broker.auth;
        let bearer = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(s, _)| s.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim());
        if let Some(token) = bearer {
            return Ok(match auth.from_token(token) {
                Ok(c) => Caller::Hub(c),
                Err(_) => Caller::PassThrough,
            });
        }
        match peer {
            Some(p) => auth.from_certificate(p).map(Caller::Hub),
            None => Err(DialError::new(
                DialErrorKind::Unauthenticated,
                "no credentials: present a hub client certificate, a hub client token, or a token of the managed cluster (Authorization: Bearer)",
            )),
        }
    }
}

const FRONTEND: &str = "service_proxy";

/// Removes every header a client must not control: `Impersonate-*` (privilege escalation
/// through forwarded impersonation, cluster-proxy #335) and `tether-*` (the broker → agent
/// protocol). Returns how many were removed.
pub fn strip_client_controlled(h: &mut http::HeaderMap) -> u64 {
    let names: Vec<HeaderName> = h
        .keys()
        .filter(|k| {
            let n = k.as_str();
            n.starts_with("impersonate-") || n.starts_with("tether-")
        })
        .cloned()
        .collect();
    let mut n = 0;
    for k in names {
        n += h.get_all(&k).iter().count() as u64;
        h.remove(&k);
    }
    n
}

/// The [`DialError`] behind a failed pooled request (the tunnel dial), or a `tunnel_lost`.
fn upstream_error(e: &hyper_util::client::legacy::Error) -> DialError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(d) = s.downcast_ref::<DialError>() {
            return d.clone();
        }
        if let Some(d) = s
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|i| i.downcast_ref::<DialError>())
        {
            return d.clone();
        }
        src = s.source();
    }
    DialError::new(
        DialErrorKind::TunnelLost,
        format!("request through the tunnel failed: {e}"),
    )
}

/// A Kubernetes `Status` answer, so kubectl prints `Error from server (<Reason>): <message>`.
fn status_response(e: &DialError) -> Response<Body> {
    let status = match e.kind {
        DialErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
        // A fairness budget: 429, as the API server's own priority and fairness answers; with
        // `Retry-After` (below) client-go and kubectl wait and retry it.
        DialErrorKind::Overloaded if crate::budget::is_budget_error(e) => {
            StatusCode::TOO_MANY_REQUESTS
        }
        k => k.status(),
    };
    let reason = match status {
        StatusCode::UNAUTHORIZED => "Unauthorized",
        StatusCode::FORBIDDEN => "Forbidden",
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::BAD_REQUEST => "BadRequest",
        StatusCode::GATEWAY_TIMEOUT => "Timeout",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
        _ => "InternalError",
    };
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": e.message, "reason": reason, "code": status.as_u16(),
    })
    .to_string();
    let mut r = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(e.kind.metric_label()) {
        h.insert(wire::HEADER_ERROR, v);
    }
    if let Some(secs) = crate::budget::retry_after(e) {
        h.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_forms_of_the_user_server() {
        let (c, r) = route("/edge-1/api/v1/namespaces/default/pods", Some("watch=1")).unwrap();
        assert_eq!(c, "edge-1");
        assert_eq!(
            r,
            Route::ApiServer {
                path_and_query: "/api/v1/namespaces/default/pods?watch=1".into()
            }
        );
        let (_, r) = route("/edge-1/version", None).unwrap();
        assert_eq!(
            r,
            Route::ApiServer {
                path_and_query: "/version".into()
            }
        );
        let (_, r) = route(
            "/c1/api/v1/namespaces/web/services/https:front:8443/proxy-service/a/b",
            Some("x=1"),
        )
        .unwrap();
        assert_eq!(
            r,
            Route::Service {
                namespace: "web".into(),
                name: "front".into(),
                https: true,
                port: 8443,
                path_and_query: "/a/b?x=1".into()
            }
        );
        let (_, r) = route(
            "/c1/api/v1/namespaces/web/services/front:80/proxy-service",
            None,
        )
        .unwrap();
        assert!(
            matches!(r, Route::Service { https: false, port: 80, ref path_and_query, .. } if path_and_query == "/")
        );
        // The k8s service proxy form is an ordinary API path (the API server enforces RBAC).
        let (_, r) = route("/c1/api/v1/namespaces/web/services/front:80/proxy/x", None).unwrap();
        assert!(matches!(r, Route::ApiServer { .. }));
        for bad in [
            "/",
            "/Edge/api",
            "/c1/api/v1/namespaces/web/services/front/proxy-service/",
            "/c1/api/v1/namespaces/web/services/front:0/proxy-service/",
            "/c1/api/v1/namespaces/We_b/services/front:80/proxy-service/",
        ] {
            assert_eq!(
                route(bad, None).unwrap_err().kind,
                DialErrorKind::BadRequest,
                "{bad}"
            );
        }
    }

    /// A budget refusal is a 429 and any refusal for capacity carries `Retry-After`, without
    /// which client-go fails a 429 or 5xx at once instead of waiting and retrying it.
    #[test]
    fn refusals_for_capacity_carry_retry_after() {
        let budget = DialError::new(
            DialErrorKind::Overloaded,
            format!(
                "{}: budgets.max_streams_per_cluster",
                crate::budget::REFUSAL_PREFIX
            ),
        );
        let limit = DialError::new(DialErrorKind::Overloaded, "too many pending dials");
        let gone = DialError::new(DialErrorKind::NoTunnel, "no tunnel");
        let retry_after = |r: &Response<Body>| {
            r.headers()
                .get(http::header::RETRY_AFTER)
                .map(|v| v.to_str().expect("ascii").to_owned())
        };
        let r = status_response(&budget);
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(retry_after(&r).as_deref(), Some("1"));
        let r = status_response(&limit);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry_after(&r).as_deref(), Some("1"));
        let r = status_response(&gone);
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(retry_after(&r), None);
    }

    #[test]
    fn client_impersonation_and_tether_headers_are_stripped() {
        let mut h = http::HeaderMap::new();
        h.append("Impersonate-Group", "system:masters".parse().unwrap());
        h.append("impersonate-group", "x".parse().unwrap());
        h.insert("Impersonate-User", "admin".parse().unwrap());
        h.insert("Impersonate-Extra-scopes", "all".parse().unwrap());
        h.insert("Impersonate-Uid", "1".parse().unwrap());
        h.insert("tether-credentials", "agent".parse().unwrap());
        h.insert("accept", "application/json".parse().unwrap());
        assert_eq!(strip_client_controlled(&mut h), 6);
        assert_eq!(h.len(), 1);
    }
}
