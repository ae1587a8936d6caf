//! A stand-in for kube-apiserver (which cannot run here): a real TLS server on 127.0.0.1:0
//! with a certificate for `kubernetes.default.svc` from the test PKI, answering `/version`,
//! `/livez` and `/healthz`, and counting the TLS connections it accepted (so tests can check
//! connection reuse).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tether_tls::Identity;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Hub;

/// Bearer token the fake API server accepts for `/version`.
pub const KUBE_TOKEN: &str = "kube-token";

/// A running fake API server.
pub struct FakeApiServer {
    pub addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

impl FakeApiServer {
    /// TLS connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// HTTP requests answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub async fn start(hub: &Hub) -> anyhow::Result<Self> {
        let acceptor = tls_acceptor(hub, "apiserver", &[b"http/1.1"])?;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let accepted = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(AtomicU64::new(0));
        let (acc, reqs) = (Arc::clone(&accepted), Arc::clone(&requests));
        tokio::spawn(async move {
            while let Ok((tcp, _)) = l.accept().await {
                // As Go's net/http (the real API server's) does on every connection: see
                // `KubeApiServer::start`.
                let _ = tcp.set_nodelay(true);
                let acceptor = acceptor.clone();
                let (acc, reqs) = (Arc::clone(&acc), Arc::clone(&reqs));
                tokio::spawn(async move {
                    let Ok(mut s) = acceptor.accept(tcp).await else {
                        return;
                    };
                    acc.fetch_add(1, Ordering::Relaxed);
                    let mut buf = vec![0u8; 8192];
                    let mut got = Vec::new();
                    loop {
                        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => got.extend_from_slice(&buf[..n]),
                            }
                        }
                        let end = got
                            .windows(4)
                            .position(|w| w == b"\r\n\r\n")
                            .expect("found")
                            + 4;
                        let head = String::from_utf8_lossy(&got[..end]).into_owned();
                        got.drain(..end);
                        reqs.fetch_add(1, Ordering::Relaxed);
                        let (code, body) = answer(&head);
                        let resp = format!(
                            "HTTP/1.1 {code}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if s.write_all(resp.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Ok(Self {
            addr,
            accepted,
            requests,
        })
    }
}

/// The TLS acceptor of a fake API server: a leaf of the hub PKI named `<name>-<random>` for
/// `kubernetes.default.svc` and `localhost`, offering `alpn`.
fn tls_acceptor(
    hub: &Hub,
    name: &str,
    alpn: &[&[u8]],
) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let leaf = hub.pki.issue(
        &format!("{name}-{:08x}", rand::random::<u32>()),
        Identity::Hub {
            component: "kube-apiserver".into(),
        },
        &["kubernetes.default.svc", "localhost"],
    )?;
    let tls = tether_tls::TlsMaterial::load(tether_tls::TlsFiles {
        cert: leaf.cert,
        key: leaf.key,
        ca: leaf.ca,
    })?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(
        tls.server_config(false, alpn)?,
    )))
}

fn answer(head: &str) -> (&'static str, String) {
    let path = head.split_whitespace().nth(1).unwrap_or("");
    match path {
        "/livez" | "/healthz" | "/readyz" => ("200 OK", "ok".into()),
        "/version" if head.to_ascii_lowercase().contains(&format!("authorization: bearer {KUBE_TOKEN}")) => (
            "200 OK",
            r#"{"major":"1","minor":"32","gitVersion":"v1.32.0-tether-test","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":"linux/amd64"}"#.into(),
        ),
        "/version" => ("401 Unauthorized", r#"{"kind":"Status","code":401}"#.into()),
        _ => ("404 Not Found", r#"{"kind":"Status","code":404}"#.into()),
    }
}

/// Bearer token of the add-on's service account in the managed cluster (the agent's
/// `service_proxy.token_file`); [`KubeApiServer`] accepts it and [`KUBE_TOKEN`].
pub const AGENT_SA_TOKEN: &str = "agent-sa-token";

/// The agent's `service_proxy` section for an API server started by [`KubeApiServer::start`]
/// on `hub`: its CA is the hub's, and the add-on's token ([`AGENT_SA_TOKEN`]) is written to a
/// file in the hub's directory. `extra` (indented YAML lines) is appended to the section.
pub fn agent_service_proxy_yaml(hub: &Hub, extra: &str) -> anyhow::Result<String> {
    let token = hub.path().join("agent-sa.token");
    std::fs::write(&token, AGENT_SA_TOKEN)?;
    Ok(format!(
        "service_proxy:\n  apiserver_ca: {}\n  token_file: {}\n{extra}",
        hub.pki.ca_path().display(),
        token.display()
    ))
}

/// What [`KubeApiServer`] saw on its last `/apis/tether.test/v1/whoami` request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    pub authorization: Option<String>,
    pub impersonate_user: Option<String>,
    pub impersonate_groups: Vec<String>,
    /// Every other `Impersonate-*` or `tether-*` header name.
    pub other_controlled: Vec<String>,
}

/// A richer stand-in for kube-apiserver, for real `kubectl` (HTTP/1.1 and HTTP/2 by ALPN, TLS
/// for `kubernetes.default.svc` from the test PKI):
///
/// - discovery (`/api`, `/apis`, `/api/v1`), `/version`, pod `default/echo` (Running);
/// - `/api/v1/pods`: a large LIST ([`LIST_PODS`] pods, [`large_list`]) for the benchmark;
/// - `/apis/tether.test/v1/whoami`: JSON of the credential and impersonation headers it got;
/// - `/api/v1/namespaces/default/pods?watch=1`: a watch that sends one event at once and the
///   next only after [`KubeApiServer::release_watch`] (so a test can tell streaming from
///   buffering), then ends;
/// - `.../pods/echo/exec` and `/attach`: a WebSocket upgrade speaking `v5.channel.k8s.io` that
///   echoes stdin to stdout (what `kubectl exec -i echo -- cat` expects), then a Success status.
///
/// Every request needs `Authorization: Bearer` [`KUBE_TOKEN`] or [`AGENT_SA_TOKEN`], else 401.
pub struct KubeApiServer {
    pub addr: SocketAddr,
    state: Arc<KubeState>,
}

#[derive(Default)]
struct KubeState {
    seen: std::sync::Mutex<Seen>,
    release: tokio::sync::Notify,
    requests: AtomicU64,
    connections: AtomicU64,
    h2_requests: AtomicU64,
    upgrades: AtomicU64,
}

type KBody = http_body_util::combinators::BoxBody<bytes::Bytes, std::convert::Infallible>;

impl KubeApiServer {
    /// The headers seen on the last `whoami`.
    pub fn seen(&self) -> Seen {
        self.state.seen.lock().expect("seen").clone()
    }
    /// Lets an open watch send its second event and end.
    pub fn release_watch(&self) {
        self.state.release.notify_one();
    }
    /// Requests answered so far (all protocols).
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::Relaxed)
    }
    /// TLS connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::Relaxed)
    }
    /// Requests that arrived over HTTP/2.
    pub fn h2_requests(&self) -> u64 {
        self.state.h2_requests.load(Ordering::Relaxed)
    }
    /// WebSocket upgrades completed.
    pub fn upgrades(&self) -> u64 {
        self.state.upgrades.load(Ordering::Relaxed)
    }

    pub async fn start(hub: &Hub) -> anyhow::Result<Self> {
        let acceptor = tls_acceptor(hub, "kube-apiserver", &[b"h2", b"http/1.1"])?;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let state = Arc::new(KubeState::default());
        let st = Arc::clone(&state);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = l.accept().await {
                // TCP_NODELAY, as Go's net/http (kube-apiserver's) sets on every connection.
                // Without it a small write behind another one not yet acknowledged (for
                // example a TLS 1.3 server's session tickets, then the first response, or the
                // end of a large response) waits for the peer's delayed ACK, up to 40 ms. The
                // bench's per-request connections had a p99 of 48 ms (1.7 ms with it) and its
                // large LISTs ran at two thirds of their speed: stalls a real server does not
                // add (docs/benchmarks.md, forty-ninth machine).
                let _ = tcp.set_nodelay(true);
                let (acceptor, st) = (acceptor.clone(), Arc::clone(&st));
                tokio::spawn(async move {
                    let Ok(s) = acceptor.accept(tcp).await else {
                        return;
                    };
                    st.connections.fetch_add(1, Ordering::Relaxed);
                    let svc = hyper::service::service_fn(move |req| {
                        let st = Arc::clone(&st);
                        async move { Ok::<_, std::convert::Infallible>(kube_answer(st, req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
                });
            }
        });
        Ok(Self { addr, state })
    }
}

fn kbody(s: impl Into<bytes::Bytes>) -> KBody {
    use http_body_util::BodyExt;
    http_body_util::Full::new(s.into()).boxed()
}

fn kjson(code: u16, body: String) -> hyper::Response<KBody> {
    hyper::Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(kbody(body))
        .expect("response")
}

const POD: &str = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"echo","namespace":"default","uid":"1"},"spec":{"containers":[{"name":"echo","image":"echo"}]},"status":{"phase":"Running"}}"#;

async fn kube_answer(
    st: Arc<KubeState>,
    mut req: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<KBody> {
    st.requests.fetch_add(1, Ordering::Relaxed);
    if req.version() == hyper::Version::HTTP_2 {
        st.h2_requests.fetch_add(1, Ordering::Relaxed);
    }
    let h = req.headers();
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let authorization = get("authorization");
    let ok_auth = [KUBE_TOKEN, AGENT_SA_TOKEN]
        .iter()
        .any(|t| authorization.as_deref() == Some(&format!("Bearer {t}")));
    if !ok_auth {
        return kjson(
            401,
            r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#.into(),
        );
    }
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    match path.as_str() {
        "/version" => kjson(
            200,
            r#"{"major":"1","minor":"32","gitVersion":"v1.32.0-tether-test","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":"linux/amd64"}"#.into(),
        ),
        "/api" => kjson(
            200,
            r#"{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[{"clientCIDR":"0.0.0.0/0","serverAddress":"kubernetes.default.svc:443"}]}"#.into(),
        ),
        "/apis" => kjson(200, r#"{"kind":"APIGroupList","apiVersion":"v1","groups":[]}"#.into()),
        "/api/v1" => kjson(
            200,
            r#"{"kind":"APIResourceList","groupVersion":"v1","resources":[{"name":"pods","singularName":"pod","namespaced":true,"kind":"Pod","verbs":["get","list","watch"],"shortNames":["po"]},{"name":"pods/exec","singularName":"","namespaced":true,"kind":"PodExecOptions","verbs":["create","get"]},{"name":"pods/attach","singularName":"","namespaced":true,"kind":"PodAttachOptions","verbs":["create","get"]}]}"#.into(),
        ),
        "/apis/tether.test/v1/whoami" => {
            let mut seen = Seen {
                authorization: authorization.clone(),
                impersonate_user: get("impersonate-user"),
                ..Seen::default()
            };
            for (k, v) in h {
                let n = k.as_str();
                if n == "impersonate-group" {
                    seen.impersonate_groups
                        .push(v.to_str().unwrap_or("").to_owned());
                } else if (n.starts_with("impersonate-") && n != "impersonate-user")
                    || n.starts_with("tether-")
                {
                    seen.other_controlled.push(n.to_owned());
                }
            }
            let body = serde_json::json!({
                "authorization": seen.authorization, "impersonateUser": seen.impersonate_user,
                "impersonateGroups": seen.impersonate_groups, "other": seen.other_controlled,
                "protocol": format!("{:?}", req.version()),
            })
            .to_string();
            *st.seen.lock().expect("seen") = seen;
            kjson(200, body)
        }
        "/api/v1/namespaces/default/pods" if query.contains("watch=") => {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<hyper::body::Frame<bytes::Bytes>, std::convert::Infallible>>(4);
            let st2 = Arc::clone(&st);
            tokio::spawn(async move {
                let ev = |n: u32| {
                    Ok(hyper::body::Frame::data(bytes::Bytes::from(format!(
                        "{{\"type\":\"ADDED\",\"object\":{{\"apiVersion\":\"v1\",\"kind\":\"Pod\",\"metadata\":{{\"name\":\"pod-{n}\",\"namespace\":\"default\"}}}}}}\n"
                    ))))
                };
                let _ = tx.send(ev(1)).await;
                st2.release.notified().await;
                let _ = tx.send(ev(2)).await;
            });
            use http_body_util::BodyExt;
            let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            hyper::Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(body.boxed())
                .expect("response")
        }
        "/api/v1/namespaces/default/pods/echo" => kjson(200, POD.into()),
        "/api/v1/pods" => hyper::Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(kbody(large_list()))
            .expect("response"),
        "/api/v1/namespaces/default/pods/echo/exec" | "/api/v1/namespaces/default/pods/echo/attach" => {
            websocket_echo(st, &mut req)
        }
        _ => kjson(
            404,
            format!(r#"{{"kind":"Status","apiVersion":"v1","status":"Failure","message":"{path} not found","reason":"NotFound","code":404}}"#),
        ),
    }
}

/// Pods in the answer to `GET /api/v1/pods` (a large LIST, about 12 MiB).
pub const LIST_PODS: usize = 65_536;

/// The body of `GET /api/v1/pods`: a `PodList` of [`LIST_PODS`] pods, built once.
pub fn large_list() -> bytes::Bytes {
    static LIST: std::sync::OnceLock<bytes::Bytes> = std::sync::OnceLock::new();
    LIST.get_or_init(|| {
        let mut b = String::from(r#"{"kind":"PodList","apiVersion":"v1","metadata":{},"items":["#);
        for i in 0..LIST_PODS {
            if i > 0 {
                b.push(',');
            }
            b.push_str(&POD.replace(r#""name":"echo""#, &format!(r#""name":"pod-{i}""#)));
        }
        b.push_str("]}");
        bytes::Bytes::from(b)
    })
    .clone()
}

/// Accepts a `v5.channel.k8s.io` WebSocket and echoes channel 0 (stdin) to channel 1 (stdout);
/// on the client's stdin close (`[255, 0]`) it sends a Success status on channel 3 and closes.
fn websocket_echo(
    st: Arc<KubeState>,
    req: &mut hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<KBody> {
    let h = req.headers();
    let key = h.get("sec-websocket-key").and_then(|v| v.to_str().ok());
    let offers_v5 = h
        .get_all("sec-websocket-protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == "v5.channel.k8s.io");
    let (Some(key), true) = (key, offers_v5) else {
        return kjson(
            400,
            r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"a v5.channel.k8s.io WebSocket upgrade is required","reason":"BadRequest","code":400}"#.into(),
        );
    };
    use base64::Engine as _;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key.as_bytes());
    ctx.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    let accept = base64::engine::general_purpose::STANDARD.encode(ctx.finish());
    let upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let Ok(up) = upgrade.await else { return };
        st.upgrades.fetch_add(1, Ordering::Relaxed);
        let _ = ws_echo(hyper_util::rt::TokioIo::new(up)).await;
    });
    hyper::Response::builder()
        .status(101)
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-accept", accept)
        .header("sec-websocket-protocol", "v5.channel.k8s.io")
        .body(kbody(bytes::Bytes::new()))
        .expect("response")
}

async fn ws_write<S: tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    opcode: u8,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut f = vec![0x80 | opcode];
    match payload.len() {
        n if n < 126 => f.push(n as u8),
        n if n <= 0xffff => {
            f.push(126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(payload);
    s.write_all(&f).await?;
    s.flush().await
}

async fn ws_echo<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
) -> std::io::Result<()> {
    loop {
        let mut head = [0u8; 2];
        s.read_exact(&mut head).await?;
        let opcode = head[0] & 0x0f;
        let masked = head[1] & 0x80 != 0;
        let len = match head[1] & 0x7f {
            126 => {
                let mut b = [0u8; 2];
                s.read_exact(&mut b).await?;
                u16::from_be_bytes(b) as usize
            }
            127 => {
                let mut b = [0u8; 8];
                s.read_exact(&mut b).await?;
                usize::try_from(u64::from_be_bytes(b)).unwrap_or(usize::MAX)
            }
            n => n as usize,
        };
        if len > 1 << 20 {
            return Err(std::io::Error::other("frame too large"));
        }
        let mut mask = [0u8; 4];
        if masked {
            s.read_exact(&mut mask).await?;
        }
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await?;
        if masked {
            for (i, b) in payload.iter_mut().enumerate() {
                *b ^= mask[i % 4];
            }
        }
        match opcode {
            0x8 => {
                let _ = ws_write(&mut s, 0x8, &payload[..payload.len().min(2)]).await;
                return Ok(());
            }
            0x9 => ws_write(&mut s, 0xA, &payload).await?,
            0x1 | 0x2 => match payload.first() {
                Some(0) => {
                    let mut out = vec![1u8];
                    out.extend_from_slice(&payload[1..]);
                    ws_write(&mut s, 0x2, &out).await?;
                }
                Some(255) if payload.get(1) == Some(&0) => {
                    let mut status = vec![3u8];
                    status.extend_from_slice(br#"{"metadata":{},"status":"Success"}"#);
                    ws_write(&mut s, 0x2, &status).await?;
                    ws_write(&mut s, 0x8, &1000u16.to_be_bytes()).await?;
                    // Wait for the client's close answer (or EOF) before dropping the socket.
                    let mut rest = [0u8; 64];
                    let _ =
                        tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut rest))
                            .await;
                    return Ok(());
                }
                _ => {}
            },
            _ => {}
        }
    }
}
