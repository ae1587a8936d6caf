//! `tetherctl proxy health | connect | kubectl`.
//!
//! - `health`: the `clusteradm proxy health` table from the hub's ManagedClusters, the
//!   `cluster-proxy` ManagedClusterAddOns and the health-prober's in-memory results
//!   (`tether.v1.health.get`); nothing is probed on demand, so it answers at once.
//! - `connect`: a local port forward (127.0.0.1:N → a target in the cluster), one tunnel stream
//!   per accepted connection: through the broker's native Dial API (`https://`), or with
//!   `http://` an HTTP CONNECT on its plain client port whose bytes the kernel moves
//!   (`plain_connect`, `kernel_relay`).
//! - `kubectl`: runs `kubectl` with a temporary kubeconfig whose server is such a local forward
//!   to the cluster's API server; TLS is end to end and verified against the cluster's CA.
//!
//! Broker access (`connect`, `kubectl`): `--broker https://host:port` (`TETHER_BROKER`; or
//! `http://host:port`, the broker's plain client listener, with a bearer token only),
//! `--broker-ca` (`TETHER_BROKER_CA`, default `<hub dir>/ca.crt`), `--broker-server-name`
//! (`TETHER_BROKER_SERVER_NAME`, default the URL's host), and either `--client-cert` +
//! `--client-key` (`TETHER_CLIENT_CERT`/`TETHER_CLIENT_KEY`, CN `tether:client:<name>`) or a
//! bearer token: `--token-file` (`TETHER_TOKEN_FILE`) or `TETHER_TOKEN`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tether_client::{ClientCert, DialStream, Dialer, DialerConfig, Token};
use tether_control::health::{self, ProxyHealthRow};
use tether_control::store::HubStore;
use tokio::net::TcpListener;

use crate::ops::connect_admin;
use crate::plain_connect::{PlainConnect, authority};
use crate::{HubArgs, Output};

/// Waits longer than this show a progress line on stderr.
pub const PROGRESS_AFTER: Duration = Duration::from_secs(1);
/// Budget of one dial through the broker.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(15);
/// Budget of connecting to the broker.
pub const BROKER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Most worker threads of the forward's runtime, and HTTP/2 connections to the broker (one
/// per worker).
pub const FORWARD_MAX_WORKERS: usize = 4;

/// Runs `fut`; if it takes longer than [`PROGRESS_AFTER`], says on stderr what is awaited.
pub async fn progress<T>(what: &str, fut: impl Future<Output = T>) -> T {
    let fut = std::pin::pin!(fut);
    let mut fut = fut;
    tokio::select! {
        r = &mut fut => return r,
        _ = tokio::time::sleep(PROGRESS_AFTER) => eprintln!("… {what}"),
    }
    let started = std::time::Instant::now();
    let r = fut.await;
    eprintln!(
        "… {what}: done after {:.1}s",
        (started.elapsed() + PROGRESS_AFTER).as_secs_f64()
    );
    r
}

#[derive(clap::Args, Debug, Clone)]
pub struct BrokerArgs {
    /// Broker client TLS listener (native Dial API), https://host:port; or the plain client
    /// listener, http://host:port (HTTP CONNECT without TLS, bearer token only).
    #[arg(long, env = "TETHER_BROKER")]
    pub broker: Option<String>,
    /// CA bundle that signed the broker's certificate [default: <hub dir>/ca.crt].
    #[arg(long, env = "TETHER_BROKER_CA")]
    pub broker_ca: Option<PathBuf>,
    /// Name checked in the broker's certificate [default: the --broker host].
    #[arg(long, env = "TETHER_BROKER_SERVER_NAME")]
    pub broker_server_name: Option<String>,
    /// Client certificate (CN tether:client:<name>), with --client-key.
    #[arg(long, env = "TETHER_CLIENT_CERT", requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    #[arg(long, env = "TETHER_CLIENT_KEY", requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// File holding a bearer token for the broker.
    #[arg(long, env = "TETHER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Hub directory (for the default CA).
    #[arg(long, env = "TETHER_HUB_DIR", default_value = "hub")]
    pub hub_dir: PathBuf,
}

fn read(p: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

/// How a forward reaches the broker.
#[derive(Clone)]
pub enum Upstream {
    /// The native Dial API over TLS (`https://`): HTTP/2 streams, one connection per worker.
    Dial(Dialer),
    /// HTTP CONNECT on the plain client port (`http://`), the bytes moved by the kernel.
    Connect(Arc<PlainConnect>),
}

impl BrokerArgs {
    /// `--broker`: (plain, host:port).
    fn endpoint(&self) -> anyhow::Result<(bool, String)> {
        let Some(endpoint) = self.broker.as_deref() else {
            bail!("no broker: pass --broker https://host:port (or set TETHER_BROKER)");
        };
        match (
            endpoint.strip_prefix("https://"),
            endpoint.strip_prefix("http://"),
        ) {
            (Some(hp), _) => Ok((false, hp.to_string())),
            (None, Some(hp)) => Ok((true, hp.to_string())),
            _ => bail!(
                "--broker {endpoint:?} must be https://host:port (client TLS listener) or \
                 http://host:port (plain client listener, bearer token only)"
            ),
        }
    }

    /// The bearer token (`--token-file`, `TETHER_TOKEN`), if any.
    fn token(&self) -> anyhow::Result<Option<Token>> {
        Ok(match (&self.token_file, std::env::var("TETHER_TOKEN")) {
            (Some(p), _) => Some(Token(read(p)?.trim().to_string())),
            (None, Ok(t)) if !t.is_empty() => Some(Token(t)),
            _ => None,
        })
    }

    /// What a forward uses: the native Dial API with `connections` HTTP/2 connections over
    /// `https://`, HTTP CONNECT per forwarded connection over `http://` (checked reachable).
    pub async fn upstream(&self, connections: usize) -> anyhow::Result<Upstream> {
        let (plain, hostport) = self.endpoint()?;
        if !plain {
            return Ok(Upstream::Dial(
                self.tls_dialer(&hostport, connections).await?,
            ));
        }
        if self.client_cert.is_some() || self.client_key.is_some() {
            bail!(
                "--broker http://{hostport} is the plain client listener: a client certificate \
                 needs https:// (use --token-file or TETHER_TOKEN with http://)"
            );
        }
        let Some(Token(token)) = self.token()? else {
            bail!(
                "no broker credential: http:// takes a bearer token (--token-file or TETHER_TOKEN)"
            );
        };
        // The token goes into the CONNECT head as it is: a line break in it would end the
        // header and start another.
        if token.bytes().any(|b| b.is_ascii_control()) {
            bail!(
                "the bearer token holds a control character (a line break?): check the token file"
            );
        }
        let up = PlainConnect {
            addr: hostport,
            token,
            connect_timeout: BROKER_CONNECT_TIMEOUT,
            dial_timeout: DIAL_TIMEOUT,
        };
        progress(
            &format!("connecting to broker http://{}", up.addr),
            up.probe(),
        )
        .await
        .with_context(|| format!("broker http://{}", up.addr))?;
        Ok(Upstream::Connect(Arc::new(up)))
    }

    /// Connects to the broker's native Dial API at `https://hostport` with `connections`
    /// HTTP/2 connections (new streams go on the least busy one).
    async fn tls_dialer(&self, hostport: &str, connections: usize) -> anyhow::Result<Dialer> {
        let endpoint = format!("https://{hostport}");
        let host = hostport
            .rsplit_once(':')
            .map(|(h, _)| h.trim_matches(['[', ']']))
            .unwrap_or(hostport)
            .to_string();
        let ca = self
            .broker_ca
            .clone()
            .unwrap_or_else(|| self.hub_dir.join("ca.crt"));
        let client_cert = match (&self.client_cert, &self.client_key) {
            (Some(c), Some(k)) => Some(ClientCert {
                cert_pem: read(c)?,
                key_pem: read(k)?,
            }),
            _ => None,
        };
        let token = self.token()?;
        if client_cert.is_none() && token.is_none() {
            bail!(
                "no broker credential: pass --client-cert/--client-key or --token-file (or set TETHER_TOKEN)"
            );
        }
        let cfg = DialerConfig {
            endpoint: endpoint.clone(),
            server_name: self.broker_server_name.clone().unwrap_or(host),
            ca_pem: read(&ca).context("broker CA (--broker-ca)")?,
            client_cert,
            token,
            connect_timeout: BROKER_CONNECT_TIMEOUT,
        };
        progress(
            &format!("connecting to broker {endpoint}"),
            Dialer::connect_pool(cfg, connections),
        )
        .await
        .with_context(|| format!("broker {endpoint}"))
    }
}

/// `tetherctl proxy health`.
pub async fn health(hub: &HubArgs, cluster: Option<&str>, output: Output) -> anyhow::Result<()> {
    let (_, conn) = progress("connecting to hub NATS", connect_admin(hub)).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let found = progress(
        "asking the health-prober",
        health::proxy_health(&conn.client, &store, cluster),
    )
    .await?;
    if let Some(c) = cluster
        && found.rows.is_empty()
    {
        bail!("cluster {c:?} is neither accepted nor has the cluster-proxy add-on");
    }
    if let Err(e) = &found.prober {
        eprintln!("warning: no health-prober answered ({e}); PROBED HEALTH is Unknown");
    }
    print_rows(&found.rows, output)
}

fn print_rows(rows: &[ProxyHealthRow], output: Output) -> anyhow::Result<()> {
    let list = serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": rows });
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&list)?),
        Output::Yaml => print!("{}", serde_saphyr::to_string(&list)?),
        Output::Table | Output::Wide => {
            print!("{}", health::render_table(rows, output == Output::Wide))
        }
    }
    Ok(())
}

/// `host:port` → (host, port).
fn parse_target(t: &str) -> anyhow::Result<(String, u16)> {
    let (h, p) = t
        .rsplit_once(':')
        .with_context(|| format!("target {t:?} is not host:port"))?;
    let port: u16 = p
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .with_context(|| format!("target {t:?}: bad port"))?;
    if h.is_empty() {
        bail!("target {t:?}: empty host");
    }
    Ok((h.trim_matches(['[', ']']).to_string(), port))
}

/// A forward listening on `listener`: every connection becomes one tunnel stream to
/// `cluster` (`target` or its API server).
async fn forward(
    listener: TcpListener,
    upstream: Upstream,
    cluster: String,
    target: Option<(String, u16)>,
) {
    let authority: Arc<str> = authority(&cluster, target.as_ref()).into();
    loop {
        let (local, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                eprintln!("accept: {e}");
                continue;
            }
        };
        match &upstream {
            Upstream::Connect(up) => {
                let (up, authority) = (Arc::clone(up), Arc::clone(&authority));
                tokio::spawn(async move { up.forward(local, peer, &authority).await });
            }
            Upstream::Dial(dialer) => {
                let (dialer, cluster, target) = (dialer.clone(), cluster.clone(), target.clone());
                tokio::spawn(forward_dial(local, peer, dialer, cluster, target));
            }
        }
    }
}

/// One forwarded connection through the native Dial API.
async fn forward_dial(
    local: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    dialer: Dialer,
    cluster: String,
    target: Option<(String, u16)>,
) {
    let dial = async {
        match &target {
            Some((h, p)) => dialer.dial(&cluster, h, *p).await,
            None => dialer.dial_api_server(&cluster).await,
        }
    };
    let mut remote = match tokio::time::timeout(DIAL_TIMEOUT, dial).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            eprintln!("connection from {peer}: {e}");
            return;
        }
        Err(_) => {
            eprintln!("connection from {peer}: dial timed out after {DIAL_TIMEOUT:?}");
            return;
        }
    };
    let _ = local.set_nodelay(true);
    if let Err(e) = splice(local, &mut remote).await {
        tracing::debug!(%peer, error = %e, "forwarded connection ended");
        // Broken on either side: reset the other at once. A plain drop after the local
        // client's EOF would linger, reading whatever the target still sends (a log follower:
        // up to LINGER_AFTER_SHUTDOWN of it) for a client that is gone.
        remote.abort();
    }
}

/// Copies both ways between a local connection and its tunnel stream until both directions
/// ended, without copying in user space: the kernel reads into a pooled buffer whose filled part
/// is handed to the stream as it is ([`tether_client::DialStream::send`]), and chunks from
/// the tunnel are written to the socket as they are. An EOF either way is passed on as a
/// half-close; an error ends both (the caller drops the stream: an abort).
async fn splice(local: tokio::net::TcpStream, remote: &mut DialStream) -> std::io::Result<()> {
    use std::pin::Pin;
    use std::task::Poll;
    use tokio::io::AsyncWrite;
    let (mut lr, mut lw) = local.into_split();
    // Reads go into buffers of one SDK data frame ([`tether_client::MAX_FRAME_BYTES`], not
    // tokio's 8 KiB default, which made 32× more frames), recycled through a pool: no 256 KiB
    // allocation per chunk.
    let pool = tether_client::ChunkPool::default();
    let mut buf: Option<Vec<u8>> = None;
    let mut up: Option<bytes::Bytes> = None;
    let mut down: Option<bytes::Bytes> = None;
    let (mut up_done, mut down_done) = (false, false);
    std::future::poll_fn(|cx| {
        // Local → tunnel.
        while !up_done {
            if let Some(chunk) = up.take() {
                match remote.poll_send_ready(cx) {
                    Poll::Ready(Ok(())) => remote.send(chunk)?,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        up = Some(chunk);
                        break;
                    }
                }
                continue;
            }
            let b = buf.get_or_insert_with(|| pool.take());
            let read = tokio_util::io::poll_read_buf(Pin::new(&mut lr), cx, b);
            // Counted for idle polling (light traffic or bulk), as the broker's sockets are.
            if let Poll::Ready(Ok(n)) = read {
                tether_idlepoll::note_io(n);
            }
            match read {
                Poll::Ready(Ok(0)) => {
                    std::task::ready!(Pin::new(&mut *remote).poll_shutdown(cx))?;
                    up_done = true;
                    buf = None;
                }
                // A small read is copied out and the buffer kept; a large one is handed over as
                // it is and its buffer comes back to the pool once h2 has written it.
                Poll::Ready(Ok(n)) if n < tether_client::COPY_BELOW => {
                    up = Some(bytes::Bytes::copy_from_slice(b));
                    b.clear();
                }
                Poll::Ready(Ok(_)) => up = buf.take().map(|b| pool.lend(b)),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
        // Tunnel → local.
        while !down_done {
            if let Some(chunk) = down.as_mut() {
                match Pin::new(&mut lw).poll_write(cx, chunk) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                    }
                    Poll::Ready(Ok(n)) => {
                        bytes::Buf::advance(chunk, n);
                        if chunk.is_empty() {
                            down = None;
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => break,
                }
                continue;
            }
            match remote.poll_recv(cx) {
                Poll::Ready(Some(Ok(b))) => {
                    tether_idlepoll::note_io(b.len());
                    down = Some(b)
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(None) => {
                    std::task::ready!(Pin::new(&mut lw).poll_shutdown(cx))?;
                    down_done = true;
                }
                Poll::Pending => break,
            }
        }
        if up_done && down_done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// `tetherctl proxy connect`.
pub async fn connect(
    broker: &BrokerArgs,
    cluster: &str,
    target: Option<&str>,
    address: &str,
    local_port: u16,
    workers: Option<usize>,
    idle_poll: Duration,
) -> anyhow::Result<()> {
    tether_tls::identity::validate_dns_label(cluster)
        .map_err(|r| anyhow::anyhow!("cluster {cluster:?}: {r}"))?;
    let target = target.map(parse_target).transpose()?;
    if let Some((h, _)) = &target
        && h.contains(':')
        && broker
            .broker
            .as_deref()
            .is_some_and(|b| b.starts_with("http://"))
    {
        bail!(
            "target {h:?}: an IPv6 address has no CONNECT authority on the plain port \
             (<host>.<cluster>.tether:<port>); use --broker https:// (the native Dial API)"
        );
    }
    // The forward (its connections to the broker included) runs on a runtime of its own (over
    // https://, one HTTP/2 connection per worker thread): see `ForwardRuntime`.
    // Default: half the CPUs, as the broker and the agent (`data_plane_workers`). On 2 CPUs one
    // worker beat two in the same-run A/B (docs/benchmarks.md): 1 stream 6.8 vs 6.4 Gbit/s and
    // 1.90 vs 2.10 CPU-s/GB, 8 streams 6.5 vs 6.2 Gbit/s — the second worker mostly added
    // cross-thread wake-ups between the local socket's task and the connection's.
    let workers = workers
        .unwrap_or_else(tether_runtime::data_plane_workers)
        .clamp(1, FORWARD_MAX_WORKERS);
    let (broker, cluster, address) = (broker.clone(), cluster.to_string(), address.to_string());
    let mut rt = ForwardRuntime::start(workers, idle_poll, async move {
        // Over https://, one HTTP/2 connection (TLS session, connection task) per worker, so
        // with several workers busy streams do not share one connection's framing and
        // encryption; over http://, a TCP connection per forwarded connection.
        let upstream = broker.upstream(workers).await?;
        let listener = TcpListener::bind((address.as_str(), local_port))
            .await
            .with_context(|| format!("cannot listen on {address}:{local_port}"))?;
        let local = listener.local_addr()?;
        let what = match &target {
            Some((h, p)) => format!("{h}:{p} in cluster {cluster}"),
            None => format!("the API server of cluster {cluster}"),
        };
        println!("Forwarding from {local} -> {what}");
        use std::io::Write as _;
        std::io::stdout().flush()?;
        forward(listener, upstream, cluster, target).await;
        anyhow::Ok(())
    })?;
    tokio::select! {
        r = &mut rt.done => r.context("the forward stopped")?,
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}

/// The runtime a forward runs on, apart from tetherctl's main one, with idle polling of at most
/// `idle_poll` ([`tether_idlepoll`], as the broker and the agent): a request through the
/// forward (kubectl's) then usually finds the forward awake, on hosts whose idle CPUs halt.
/// With one worker thread (the default on up to three CPUs) a current-thread runtime on a
/// thread of its own; with more, a multi-thread runtime whose last worker awake polls.
struct ForwardRuntime {
    /// The forward's result (an error, or its end).
    done: tokio::sync::oneshot::Receiver<anyhow::Result<()>>,
    /// A multi-thread runtime, stopped without waiting when dropped; none for the
    /// current-thread one, which ends with the process.
    multi: Option<tokio::runtime::Runtime>,
}

impl ForwardRuntime {
    fn start<F>(workers: usize, idle_poll: Duration, forward: F) -> anyhow::Result<Self>
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let (tx, done) = tokio::sync::oneshot::channel();
        if workers == 1 {
            let mut b = tokio::runtime::Builder::new_current_thread();
            b.enable_all();
            let rt = tether_idlepoll::build_current_thread(&mut b, idle_poll)
                .context("starting the forward's runtime")?;
            tracing::debug!(idle_poll = tether_idlepoll::status(), "forward runtime");
            std::thread::Builder::new()
                .name("tetherctl-forward".into())
                .spawn(move || {
                    let _ = tx.send(rt.block_on(forward));
                })
                .context("starting the forward's thread")?;
            return Ok(Self { done, multi: None });
        }
        let rt = tether_idlepoll::build_multi_thread(
            tokio::runtime::Builder::new_multi_thread()
                .thread_name("tetherctl-forward")
                .enable_all(),
            idle_poll,
            workers,
        )
        .context("starting the forward's runtime")?;
        tracing::debug!(idle_poll = tether_idlepoll::status(), "forward runtime");
        rt.spawn(async move {
            let _ = tx.send(forward.await);
        });
        Ok(Self {
            done,
            multi: Some(rt),
        })
    }
}

impl Drop for ForwardRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.multi.take() {
            rt.shutdown_background();
        }
    }
}

/// Options of `tetherctl proxy kubectl`.
#[derive(clap::Args, Debug, Clone)]
pub struct KubectlArgs {
    /// Managed cluster whose API server kubectl talks to.
    #[arg(long)]
    pub cluster: String,
    /// The cluster's own kubeconfig: its current context's CA, TLS server name and user are
    /// kept, only the server is replaced by the tunnel.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// CA bundle of the cluster's API server (when no --kubeconfig).
    #[arg(long)]
    pub cluster_ca: Option<PathBuf>,
    /// Name checked in the API server's certificate.
    #[arg(long, default_value = "kubernetes.default.svc")]
    pub tls_server_name: String,
    /// Bearer token for the API server (when no --kubeconfig), from this file.
    #[arg(long)]
    pub kube_token_file: Option<PathBuf>,
    /// kubectl binary.
    #[arg(long, env = "TETHER_KUBECTL", default_value = "kubectl")]
    pub kubectl: PathBuf,
    /// Idle polling of the forward, as the broker's and agent's.
    #[command(flatten)]
    pub idle_poll: tether_runtime::IdlePollArgs,
    /// Arguments for kubectl (after `--`).
    #[arg(last = true)]
    pub args: Vec<String>,
}

/// The temporary kubeconfig: server = the local forward, CA and user from the cluster.
fn kubeconfig(a: &KubectlArgs, local: std::net::SocketAddr) -> anyhow::Result<serde_json::Value> {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let server = format!("https://{local}");
    let (mut cluster, user) = match &a.kubeconfig {
        Some(path) => {
            let text = read(path)?;
            let kc: serde_json::Value = serde_saphyr::from_str(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let base = path.parent().unwrap_or(Path::new("."));
            let current = kc["current-context"].as_str().unwrap_or_default();
            let ctx = kc["contexts"]
                .as_array()
                .and_then(|v| {
                    v.iter()
                        .find(|c| c["name"] == current)
                        .or_else(|| v.first())
                })
                .with_context(|| format!("{}: no context", path.display()))?;
            let find = |list: &str, name: &serde_json::Value| {
                kc[list]
                    .as_array()
                    .and_then(|v| v.iter().find(|x| x["name"] == *name))
                    .cloned()
            };
            let cluster = find("clusters", &ctx["context"]["cluster"])
                .with_context(|| format!("{}: context names no cluster", path.display()))?;
            let mut c = cluster["cluster"].clone();
            // The original server's host is the name its certificate carries.
            if c.get("tls-server-name").is_none()
                && let Some(host) = c["server"]
                    .as_str()
                    .and_then(|s| s.split("://").nth(1))
                    .map(|s| s.split(['/', ':']).next().unwrap_or(s).to_string())
            {
                c["tls-server-name"] = host.into();
            }
            if let Some(p) = c["certificate-authority"].as_str() {
                c["certificate-authority"] = base.join(p).display().to_string().into();
            }
            let mut user = find("users", &ctx["context"]["user"])
                .map(|u| u["user"].clone())
                .unwrap_or_else(|| serde_json::json!({}));
            for k in ["client-certificate", "client-key", "tokenFile"] {
                if let Some(p) = user[k].as_str() {
                    user[k] = base.join(p).display().to_string().into();
                }
            }
            (c, user)
        }
        None => {
            let ca = a.cluster_ca.as_ref().context(
                "pass --kubeconfig (the cluster's) or --cluster-ca: TLS to the API server is verified",
            )?;
            let mut user = serde_json::json!({});
            if let Some(t) = &a.kube_token_file {
                user["token"] = read(t)?.trim().into();
            }
            (
                serde_json::json!({
                    "certificate-authority-data": b64(&read(ca)?),
                    "tls-server-name": a.tls_server_name,
                }),
                user,
            )
        }
    };
    cluster["server"] = server.into();
    cluster
        .as_object_mut()
        .context("cluster entry is not a map")?
        .remove("proxy-url");
    let name = format!("tether-{}", a.cluster);
    Ok(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }))
}

/// `tetherctl proxy kubectl`: returns kubectl's exit code.
pub async fn kubectl(broker: &BrokerArgs, a: &KubectlArgs) -> anyhow::Result<i32> {
    tether_tls::identity::validate_dns_label(&a.cluster)
        .map_err(|r| anyhow::anyhow!("cluster {:?}: {r}", a.cluster))?;
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let kc = kubeconfig(a, local)?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, serde_json::to_string_pretty(&kc)?)?;
    // The forward on a runtime of its own (one thread, idle polling: kubectl's requests are
    // light traffic); kubectl starts once the broker is reached.
    let (ready, is_ready) = tokio::sync::oneshot::channel();
    let (broker, cluster) = (broker.clone(), a.cluster.clone());
    let idle_poll = a.idle_poll.max();
    let _fwd = ForwardRuntime::start(1, idle_poll, async move {
        let setup = async {
            let listener = TcpListener::from_std(listener)?;
            anyhow::Ok((listener, broker.upstream(1).await?))
        };
        match setup.await {
            Ok((listener, upstream)) => {
                let _ = ready.send(Ok(()));
                forward(listener, upstream, cluster, None).await;
            }
            Err(e) => {
                let _ = ready.send(Err(e));
            }
        }
        Ok(())
    })?;
    is_ready.await.context("the forward stopped")??;
    let status = tokio::process::Command::new(&a.kubectl)
        .arg("--kubeconfig")
        .arg(&path)
        .args(&a.args)
        .env("KUBECONFIG", &path)
        .status()
        .await
        .with_context(|| format!("running {}", a.kubectl.display()))?;
    Ok(status.code().unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token with a line break would inject headers into the CONNECT head: refused by name
    /// before anything is dialled (the broker address is never connected to).
    #[tokio::test]
    async fn a_token_with_a_line_break_is_refused_over_http() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "abc\r\nx-injected: 1\n").unwrap();
        let args = BrokerArgs {
            broker: Some("http://127.0.0.1:9".into()),
            broker_ca: None,
            broker_server_name: None,
            client_cert: None,
            client_key: None,
            token_file: Some(token),
            hub_dir: dir.path().into(),
        };
        let e = args
            .upstream(1)
            .await
            .err()
            .expect("the token was accepted");
        assert!(e.to_string().contains("control character"), "{e:#}");
    }

    #[test]
    fn targets_parse() {
        assert_eq!(
            parse_target("web.default.svc:8080").unwrap(),
            ("web.default.svc".to_string(), 8080)
        );
        assert!(parse_target("nohost").is_err());
        assert!(parse_target("h:0").is_err());
    }

    #[test]
    fn kubeconfig_keeps_ca_and_user_and_replaces_server() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("kc.yaml");
        std::fs::write(
            &src,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts:\n- name: c\n  context: {cluster: k, user: u}\nclusters:\n- name: k\n  cluster:\n    server: https://kubernetes.default.svc:443\n    certificate-authority: ca.crt\n    proxy-url: http://p:3128\nusers:\n- name: u\n  user: {token: abc}\n",
        )
        .unwrap();
        let a = KubectlArgs {
            cluster: "c1".into(),
            kubeconfig: Some(src),
            cluster_ca: None,
            tls_server_name: "kubernetes.default.svc".into(),
            kube_token_file: None,
            kubectl: "kubectl".into(),
            idle_poll: tether_runtime::IdlePollArgs { idle_poll_us: 0 },
            args: vec![],
        };
        let kc = kubeconfig(&a, "127.0.0.1:5555".parse().unwrap()).unwrap();
        let c = &kc["clusters"][0]["cluster"];
        assert_eq!(c["server"], "https://127.0.0.1:5555");
        assert_eq!(c["tls-server-name"], "kubernetes.default.svc");
        assert!(c.get("proxy-url").is_none());
        assert!(
            c["certificate-authority"]
                .as_str()
                .unwrap()
                .ends_with("ca.crt")
        );
        assert_eq!(kc["users"][0]["user"]["token"], "abc");
    }
}
