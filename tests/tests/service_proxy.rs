//! The brokers' HTTP service proxy with real `kubectl` (docs/service-proxy.md).
//!
//! Hub control plane (nats-server + addon-manager), one broker with `service_proxy` and a
//! control plane, one tunnel-agent with `service_proxy` whose API server is an HTTPS API-like
//! server ([`KubeApiServer`]) and whose cluster holds a plain HTTP service `web.default.svc:8080`.
//! `tetherctl kubeconfig` writes the kubeconfigs; kubectl then runs with `--kubeconfig` only:
//!
//! - `get --raw /c1/version` (`--raw` takes a server-relative URI: kubectl drops the
//!   kubeconfig's path for it, so the cluster prefix is written out; typed requests such as
//!   `exec` use the kubeconfig's `/c1` path) with a hub client token (impersonation) and a cluster token
//!   (pass-through);
//! - `--as admin --as-group system:masters`: those headers never reach the target; the target
//!   sees the agent's credential and `Impersonate-User: tether:client:ops` (or, passed through,
//!   the client's own token and no impersonation); a hub client certificate from
//!   `tetherctl client create --cert-out` is impersonated as `tether:client:bot`;
//! - a watch whose second event is only produced after the first was printed (streaming);
//! - `exec -i echo -- cat` over a WebSocket upgrade that echoes;
//! - the service is refused with a clear message until `tetherctl apply -f` allows it; a bad
//!   KV update keeps the last good allowlist; `tetherctl delete` denies it again;
//! - broker → agent connections are pooled (fewer tunnel dials than requests), and the agent
//!   speaks HTTP/2 to the target.
//!
//! Run: `cargo build -p tetherctl -p tunnel-broker -p tunnel-agent -p addon-manager --bins &&
//! cargo test -p tether-e2e --test service_proxy`.

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tether_control::store::Store as _;
use tether_e2e::apiserver::{AGENT_SA_TOKEN, KUBE_TOKEN, KubeApiServer, agent_service_proxy_yaml};
use tether_e2e::control_plane::{ControlPlane, broker_control_plane_yaml, tunnel_hub_from_ca};
use tether_e2e::{OPS_TOKEN, metric, wait_tunnel};
use tether_test_support::bin;

const KUBECTL_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs kubectl with `kubeconfig` (and a private discovery cache); (success, stdout, stderr).
async fn kubectl(
    kubeconfig: &Path,
    args: &[&str],
    stdin: Option<&str>,
) -> anyhow::Result<(bool, String, String)> {
    let cache = kubeconfig.with_extension("cache");
    let mut c = tokio::process::Command::new("kubectl");
    c.arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--cache-dir")
        .arg(&cache)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = c.spawn().context("run kubectl")?;
    if let Some(input) = stdin {
        use tokio::io::AsyncWriteExt as _;
        let mut si = child.stdin.take().context("stdin")?;
        si.write_all(input.as_bytes()).await?;
        drop(si);
    }
    let out = tokio::time::timeout(KUBECTL_TIMEOUT, child.wait_with_output())
        .await
        .with_context(|| format!("kubectl {args:?} did not finish in {KUBECTL_TIMEOUT:?}"))??;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

async fn kubectl_ok(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
    let (ok, out, err) = kubectl(kubeconfig, args, None).await?;
    if !ok {
        bail!("kubectl {args:?} failed: {err}{out}");
    }
    Ok(out)
}

/// `tetherctl kubeconfig c1 --server … CREDENTIAL… -o FILE`.
fn write_kubeconfig(
    cp: &ControlPlane,
    server: &str,
    out: &Path,
    cred: &[&str],
) -> anyhow::Result<()> {
    let o = std::process::Command::new(bin("tetherctl")?)
        .args(["kubeconfig", "c1", "--server", server, "--hub-dir"])
        .arg(&cp.hub_dir)
        .args(cred)
        .arg("-o")
        .arg(out)
        .output()?;
    if !o.status.success() {
        bail!(
            "tetherctl kubeconfig: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(())
}

/// A plain HTTP service answering `hello from web <path>` to every request.
async fn web_service() -> anyhow::Result<std::net::SocketAddr> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0) + 4;
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end);
                    let path = head.split_whitespace().nth(1).unwrap_or("?").to_owned();
                    let body = format!("hello from web {path}\n");
                    let r = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(r.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_through_the_service_proxy() -> anyhow::Result<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let cp = ControlPlane::start(dir.path())?;
    let hub = tunnel_hub_from_ca(&cp.hub_dir)?;
    let api = KubeApiServer::start(&hub).await?;
    let web = web_service().await?;

    let broker = hub.start_broker(
        "sp1",
        &format!(
            "{}  enforce_clusters: false\n  discover_peers: false\nservice_proxy:\n  listen: 127.0.0.1:0\n",
            broker_control_plane_yaml(&cp.hub_dir, &cp.nats_url, "localhost")
        ),
    )?;
    let sp_addr = hub.service_proxy_addr("sp1")?;
    let _agent = hub.start_agent(
        "c1",
        "c1",
        &[vec![broker.agent_addr]],
        api.addr,
        &agent_service_proxy_yaml(
            &hub,
            &format!("  service_addresses:\n    'web.default.svc:8080': '{web}'\n"),
        )?,
    )?;
    wait_tunnel(&broker, "c1").await?;

    // Kubeconfigs: a hub client token (impersonation) and a cluster token (pass-through).
    let server = format!("https://{sp_addr}");
    let write_token = |name: &str, token: &str| -> anyhow::Result<PathBuf> {
        let p = dir.path().join(name);
        std::fs::write(&p, token)?;
        Ok(p)
    };
    let hub_kc = dir.path().join("hub.kubeconfig");
    let ops = write_token("ops.token", OPS_TOKEN)?;
    write_kubeconfig(
        &cp,
        &server,
        &hub_kc,
        &["--token-file", ops.to_str().context("path")?],
    )?;
    let kube_kc = dir.path().join("kube.kubeconfig");
    let kt = write_token("kube.token", KUBE_TOKEN)?;
    write_kubeconfig(
        &cp,
        &server,
        &kube_kc,
        &["--token-file", kt.to_str().context("path")?],
    )?;
    let text = std::fs::read_to_string(&hub_kc)?;
    assert!(text.contains(&format!("server: {server}/c1")), "{text}");
    assert!(!text.contains("proxy-url"), "{text}");

    // get --raw, both ways of authenticating.
    for kc in [&hub_kc, &kube_kc] {
        let out = kubectl_ok(kc, &["get", "--raw", "/c1/version"]).await?;
        assert!(out.contains("v1.32.0-tether-test"), "{out}");
    }

    // Client impersonation never reaches the target.
    let whoami = [
        "--as",
        "admin",
        "--as-group",
        "system:masters",
        "get",
        "--raw",
        "/c1/apis/tether.test/v1/whoami",
    ];
    kubectl_ok(&hub_kc, &whoami).await?;
    let seen = api.seen();
    assert_eq!(
        seen.authorization.as_deref(),
        Some(&*format!("Bearer {AGENT_SA_TOKEN}"))
    );
    assert_eq!(seen.impersonate_user.as_deref(), Some("tether:client:ops"));
    assert_eq!(seen.impersonate_groups, vec!["tether:clients".to_string()]);
    assert!(seen.other_controlled.is_empty(), "{seen:?}");
    kubectl_ok(&kube_kc, &whoami).await?;
    let seen = api.seen();
    assert_eq!(
        seen.authorization.as_deref(),
        Some(&*format!("Bearer {KUBE_TOKEN}"))
    );
    assert_eq!(seen.impersonate_user, None);
    assert!(
        seen.impersonate_groups.is_empty() && seen.other_controlled.is_empty(),
        "{seen:?}"
    );
    assert!(
        metric(
            broker.admin_addr,
            "tether_broker_service_proxy_stripped_headers_total",
            &[]
        )
        .await?
            >= 4.0
    );

    // A hub client certificate (issued by the hub) is a hub identity too.
    let bot = dir.path().join("bot");
    cp.tetherctl(&[
        "client",
        "create",
        "bot",
        "--cert-out",
        bot.to_str().context("path")?,
    ])?;
    let cert_kc = dir.path().join("cert.kubeconfig");
    let (crt, key) = (bot.join("tls.crt"), bot.join("tls.key"));
    write_kubeconfig(
        &cp,
        &server,
        &cert_kc,
        &[
            "--cert",
            crt.to_str().context("path")?,
            "--key",
            key.to_str().context("path")?,
        ],
    )?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // The broker learns the new HubClient from KV: retry until it has.
        let (ok, _, err) = kubectl(&cert_kc, &whoami, None).await?;
        if ok {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "client certificate never accepted: {err}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = api.seen();
    assert_eq!(seen.impersonate_user.as_deref(), Some("tether:client:bot"));
    assert_eq!(seen.impersonate_groups, vec!["tether:clients".to_string()]);

    // A watch streams: the second event exists only after the first was printed.
    let mut w = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&hub_kc)
        .args(["get", "--raw", "/c1/api/v1/namespaces/default/pods?watch=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = w.stdout.take().context("stdout")?;
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let first = rx
        .recv_timeout(KUBECTL_TIMEOUT)
        .context("no first watch event")??;
    assert!(first.contains("pod-1"), "{first}");
    assert!(
        w.try_wait()?.is_none(),
        "kubectl ended before the watch did"
    );
    api.release_watch();
    let second = rx
        .recv_timeout(KUBECTL_TIMEOUT)
        .context("no second watch event")??;
    assert!(second.contains("pod-2"), "{second}");
    let deadline = Instant::now() + KUBECTL_TIMEOUT;
    let status = loop {
        if let Some(s) = w.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = w.kill();
            bail!("kubectl watch did not end after the stream ended");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success());

    // An upgraded connection (kubectl exec over WebSocket) echoes.
    let input = "hello through the tunnel\nsecond line\n";
    let (ok, out, err) =
        kubectl(&hub_kc, &["exec", "-i", "echo", "--", "cat"], Some(input)).await?;
    assert!(ok, "kubectl exec failed: {err}");
    assert_eq!(out, input);
    assert!(api.upgrades() >= 1);

    // A service outside the allowlist is refused, with a message that says so.
    let svc = [
        "get",
        "--raw",
        "/c1/api/v1/namespaces/default/services/web:8080/proxy-service/hello",
    ];
    let (ok, _, err) = kubectl(&hub_kc, &svc, None).await?;
    assert!(!ok);
    assert!(
        err.contains("Forbidden") && err.contains("not in the service proxy allowlist"),
        "{err}"
    );
    let allow = dir.path().join("allow.yaml");
    let mut f = std::fs::File::create(&allow)?;
    writeln!(
        f,
        "apiVersion: proxy.tether.io/v1alpha1\nkind: ServiceProxyAllowlist\nmetadata:\n  name: web\nspec:\n  services:\n    - clusters: ['c1']\n      namespace: default\n      name: web\n      ports: [8080]"
    )?;
    drop(f);
    let applied = cp.tetherctl(&["apply", "-f", allow.to_str().context("path")?])?;
    assert!(
        applied.contains("serviceproxyallowlist/web created"),
        "{applied}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (ok, out, err) = kubectl(&hub_kc, &svc, None).await?;
        if ok {
            assert_eq!(out.trim(), "hello from web /hello");
            break;
        }
        if Instant::now() > deadline {
            bail!("service still refused 20 s after tetherctl apply: {err}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A bad update keeps the last good list; deleting the allowlist denies the service again.
    let admin = cp.admin().await?;
    let store = tether_control::store::HubStore::open(admin.client.clone()).await?;
    let mut bad = serde_json::json!({"apiVersion": "proxy.tether.io/v1alpha1", "kind": "ServiceProxyAllowlist",
        "metadata": {"name": "web"}, "spec": {"services": [{"clusters": ["c1"], "namespace": "default", "name": "web"}]}});
    bad["spec"]["services"][0]["ports"] = serde_json::json!([0]);
    store
        .put(
            tether_control::store::Bucket::ServiceProxyAllowlists,
            "web",
            &bad,
        )
        .await?;
    let rejected = || {
        metric(
            broker.admin_addr,
            "tether_broker_service_proxy_allowlist_rejected_total",
            &[],
        )
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while rejected().await? < 1.0 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the broker never saw the bad allowlist update"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = kubectl_ok(&hub_kc, &svc).await?;
    assert_eq!(
        out.trim(),
        "hello from web /hello",
        "the last good allowlist was not kept"
    );
    let deleted = cp.tetherctl(&["delete", "serviceproxyallowlist", "web"])?;
    assert!(
        deleted.contains("serviceproxyallowlist/web deleted"),
        "{deleted}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (ok, _, err) = kubectl(&hub_kc, &svc, None).await?;
        if !ok {
            assert!(err.contains("not in the service proxy allowlist"), "{err}");
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "service still allowed 20 s after the allowlist was deleted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Pooling: a burst of requests reuses tunnel streams; the agent speaks HTTP/2 upstream.
    let dials = || {
        metric(
            broker.admin_addr,
            "tether_broker_dial_duration_seconds_count",
            &[("frontend", "service_proxy")],
        )
    };
    let before = dials().await?;
    for _ in 0..5 {
        kubectl_ok(&hub_kc, &["get", "--raw", "/c1/version"]).await?;
    }
    let new_dials = dials().await? - before;
    assert!(
        new_dials < 5.0,
        "{new_dials} tunnel dials for 5 requests: the pool is not reused"
    );
    assert!(
        api.h2_requests() > 0,
        "the agent never spoke HTTP/2 to the API server"
    );
    let ok200 = metric(
        broker.admin_addr,
        "tether_broker_service_proxy_requests_total",
        &[("cluster", "c1"), ("code", "200")],
    )
    .await?;
    assert!(ok200 >= 10.0, "{ok200}");
    eprintln!(
        "service proxy e2e: {:?}, {} API requests over {} TLS connections, {new_dials} dials for 5 requests",
        started.elapsed(),
        api.requests(),
        api.connections()
    );
    Ok(())
}

/// A client that stops reading a large response is cut off once the broker's write to it has
/// made no progress for `tunnel.write_stall_timeout`: its connection ends short of the
/// `content-length` (never a clean end of a shorter body), and the tunnel stream it held ends
/// on the broker and on the agent (both open-stream gauges back to 0). A client that reads
/// slowly but steadily is never cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_off_and_frees_its_stream() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    const STALL: Duration = Duration::from_secs(1);
    const DEADLINE: Duration = Duration::from_secs(30);
    let hub = tether_e2e::Hub::new()?;
    let api = KubeApiServer::start(&hub).await?;
    let broker = hub.start_broker(
        "st1",
        &format!(
            "service_proxy:\n  listen: 127.0.0.1:0\ntunnel:\n  write_stall_timeout: {}ms\n",
            STALL.as_millis()
        ),
    )?;
    let sp_addr = hub.service_proxy_addr("st1")?;
    let agent = hub.start_agent(
        "c1",
        "c1",
        &[vec![broker.agent_addr]],
        api.addr,
        &agent_service_proxy_yaml(&hub, "")?,
    )?;
    tether_e2e::wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    let tls = std::sync::Arc::new(tether_e2e::client_tls_config(
        &hub.pki.ca_path(),
        &[b"http/1.1"],
        None,
    )?);
    let body_len = tether_e2e::apiserver::large_list().len();

    // A small receive buffer, so that the broker's writes stall long before the body is out.
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.set_recv_buffer_size(64 << 10)?;
    let tcp = sock.connect(sp_addr).await?;
    let mut client = tokio_rustls::TlsConnector::from(std::sync::Arc::clone(&tls))
        .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
        .await?;
    client
        .write_all(
            format!(
                "GET /c1/api/v1/pods HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {OPS_TOKEN}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await?;
    let mut got = vec![0u8; 4096];
    let n = tokio::time::timeout(DEADLINE, client.read(&mut got))
        .await
        .context("the response head")??;
    let head = String::from_utf8_lossy(&got[..n]).into_owned();
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "{head}");
    let open = |addr| async move {
        anyhow::Ok((
            metric(
                addr,
                "tether_broker_open_streams",
                &[("frontend", "service_proxy")],
            )
            .await?,
            metric(agent.admin_addr, "tether_agent_open_streams", &[]).await?,
        ))
    };
    anyhow::ensure!(
        open(broker.admin_addr).await? == (1.0, 1.0),
        "one stream on each side while the body moves"
    );

    // The client stops reading here. The streams must end by themselves.
    let stalled = Instant::now();
    loop {
        let (b, a) = open(broker.admin_addr).await?;
        if b == 0.0 && a == 0.0 {
            break;
        }
        anyhow::ensure!(
            stalled.elapsed() < DEADLINE,
            "a stalled client still holds streams after {DEADLINE:?}: broker {b}, agent {a}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let freed = stalled.elapsed();
    anyhow::ensure!(
        freed >= STALL,
        "freed after {freed:?}, before the stall timeout"
    );
    // What the client still gets is what was buffered, then the end: short of the body.
    let mut rest = 0usize;
    let mut buf = vec![0u8; 256 << 10];
    let end = loop {
        match tokio::time::timeout(DEADLINE, client.read(&mut buf)).await? {
            Ok(0) => break "EOF".to_string(),
            Ok(k) => rest += k,
            Err(e) => break e.to_string(),
        }
    };
    let body_got = n - head.find("\r\n\r\n").map_or(n, |i| i + 4) + rest;
    anyhow::ensure!(
        body_got < body_len,
        "the stalled client got the whole body ({body_got} bytes): nothing stalled"
    );
    println!(
        "stalled client: streams freed {freed:?} after it stopped reading (stall timeout {STALL:?}); it got {body_got} of {body_len} body bytes, then {end}"
    );

    // A slow client that keeps reading gets the whole body on the same broker.
    let tcp = tokio::net::TcpStream::connect(sp_addr).await?;
    let mut slow = tokio_rustls::TlsConnector::from(tls)
        .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
        .await?;
    slow.write_all(
        format!(
            "GET /c1/api/v1/pods HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {OPS_TOKEN}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    let started = Instant::now();
    let mut all = Vec::new();
    let mut chunk = vec![0u8; 32 << 10];
    loop {
        let k = tokio::time::timeout(DEADLINE, slow.read(&mut chunk)).await??;
        if k == 0 {
            break;
        }
        all.extend_from_slice(&chunk[..k]);
        // The stimulus: a reader slower than the path, never pausing near the stall timeout.
        tokio::time::sleep(Duration::from_millis(2)).await;
        anyhow::ensure!(
            started.elapsed() < DEADLINE * 2,
            "the slow read never ended"
        );
    }
    let text = String::from_utf8_lossy(&all[..all.len().min(4096)]).into_owned();
    let head_len = text.find("\r\n\r\n").context("a response head")? + 4;
    anyhow::ensure!(text.starts_with("HTTP/1.1 200"), "{}", &text[..head_len]);
    anyhow::ensure!(
        all.len() - head_len == body_len,
        "the slow client got {} of {body_len} body bytes",
        all.len() - head_len
    );
    println!(
        "slow client: the whole body in {:?} (stall timeout {STALL:?})",
        started.elapsed()
    );
    Ok(())
}
