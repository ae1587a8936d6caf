//! The admin HTTP server every service runs: `/healthz`, `/readyz`, `/metrics`, plus JSON
//! debug routes registered by the service (e.g. the broker's `/debug/tunnels`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Time allowed to read an admin request's headers.
pub const ADMIN_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Concurrent admin connections served at most.
pub const MAX_ADMIN_CONNECTIONS: usize = 64;

/// Whether a service is ready, and if not, why. Cheap to clone.
#[derive(Clone)]
pub struct Readiness {
    tx: Arc<watch::Sender<Result<(), String>>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    /// Starts not ready ("starting").
    pub fn new() -> Self {
        Self {
            tx: Arc::new(watch::channel(Err("starting".to_owned())).0),
        }
    }

    pub fn set_ready(&self) {
        let _previous = self.tx.send_replace(Ok(()));
    }

    pub fn set_not_ready(&self, reason: impl Into<String>) {
        let _previous = self.tx.send_replace(Err(reason.into()));
    }

    pub fn get(&self) -> Result<(), String> {
        self.tx.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Result<(), String>> {
        self.tx.subscribe()
    }
}

/// A JSON debug route: gets the request's query string (if any), answers a JSON body.
type DebugRoute = Arc<dyn Fn(Option<&str>) -> String + Send + Sync>;

/// The admin server of one process.
#[derive(Clone)]
pub struct AdminServer {
    registry: Registry,
    readiness: Readiness,
    routes: HashMap<&'static str, DebugRoute>,
}

impl AdminServer {
    pub fn new(registry: Registry, readiness: Readiness) -> Self {
        Self {
            registry,
            readiness,
            routes: HashMap::new(),
        }
    }

    /// Adds a GET route answering JSON produced by `f`.
    pub fn with_json_route(
        mut self,
        path: &'static str,
        f: impl Fn() -> String + Send + Sync + 'static,
    ) -> Self {
        self.routes.insert(path, Arc::new(move |_| f()));
        self
    }

    /// Adds a GET route answering JSON produced by `f` from the request's query string (e.g.
    /// the broker's test-only fault injection, `/debug/test/panic-tunnel?cluster=…`).
    pub fn with_json_query_route(
        mut self,
        path: &'static str,
        f: impl Fn(Option<&str>) -> String + Send + Sync + 'static,
    ) -> Self {
        self.routes.insert(path, Arc::new(f));
        self
    }

    /// Serves on `listener` until `shutdown`.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) {
        let this = Arc::new(self);
        let permits = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
        loop {
            let (stream, _) = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "admin accept failed");
                        continue;
                    }
                },
            };
            let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                continue; // over the cap: drop the connection
            };
            let this = Arc::clone(&this);
            tokio::spawn(async move {
                let _permit = permit;
                let svc = service_fn(move |req| {
                    let this = Arc::clone(&this);
                    async move { Ok::<_, Infallible>(this.handle(req)) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(ADMIN_HEADER_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), svc);
                let _ = conn.await;
            });
        }
    }

    fn handle(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let text = |code: StatusCode, body: String| {
            Response::builder()
                .status(code)
                .header("content-type", "text/plain; charset=utf-8")
                .body(Full::new(Bytes::from(body)))
                .expect("valid response")
        };
        match req.uri().path() {
            "/healthz" | "/livez" => text(StatusCode::OK, "ok\n".into()),
            "/readyz" => match self.readiness.get() {
                Ok(()) => text(StatusCode::OK, "ready\n".into()),
                Err(reason) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: {reason}\n"),
                ),
            },
            "/metrics" => {
                let mut buf = Vec::new();
                let enc = TextEncoder::new();
                if let Err(e) = enc.encode(&self.registry.gather(), &mut buf) {
                    return text(StatusCode::INTERNAL_SERVER_ERROR, format!("encode: {e}\n"));
                }
                Response::builder()
                    .header("content-type", enc.format_type())
                    .body(Full::new(Bytes::from(buf)))
                    .expect("valid response")
            }
            path => match self.routes.get(path) {
                Some(f) => Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(f(req.uri().query()))))
                    .expect("valid response"),
                None => text(StatusCode::NOT_FOUND, format!("no route {path}\n")),
            },
        }
    }
}

/// Registers a metric as it is built — `IntGauge::new(…).registered(registry)?` — so a
/// metrics struct cannot declare a metric and forget to export it, and no list of its fields
/// is kept twice.
pub trait Registered<C> {
    /// The metric, registered with `registry` (stops at the first error, e.g. a duplicate name).
    fn registered(self, registry: &Registry) -> prometheus::Result<C>;
}

impl<C: prometheus::core::Collector + Clone + 'static> Registered<C> for prometheus::Result<C> {
    fn registered(self, registry: &Registry) -> prometheus::Result<C> {
        let metric = self?;
        registry.register(Box::new(metric.clone()))?;
        Ok(metric)
    }
}
