//! `tetherctl proxy connect` (local port forward through a broker's native Dial API) and
//! `tetherctl proxy kubectl` (kubectl with a temporary kubeconfig whose server is a local
//! forward to the cluster's API server, TLS verified against the cluster's CA) against a real
//! broker and tunnel-agent.
//!
//! kubectl: the real one when `kubectl` runs here, and always a stand-in (`python3`) that reads
//! the kubeconfig exactly as kubectl would (server, certificate-authority-data,
//! tls-server-name, token) and makes the HTTPS request with verification.
//!
//! Run: `cargo build -p tetherctl -p tunnel-broker -p tunnel-agent --bins && cargo test -p tether-e2e --test tetherctl_proxy`.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use tether_e2e::apiserver::{FakeApiServer, KUBE_TOKEN};
use tether_e2e::{Broker, Hub, OPS_TOKEN, echo_server, wait_agent_ready, wait_tunnel};
use tether_test_support::bin;

/// Kills the process on drop.
struct Guard(std::process::Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const FAKE_KUBECTL: &str = r#"#!/usr/bin/env python3
# Stand-in for kubectl: honours --kubeconfig like kubectl and runs `get --raw PATH`.
import base64, json, ssl, sys, tempfile, urllib.request
args = sys.argv[1:]
kc = json.load(open(args[args.index("--kubeconfig") + 1]))
ctx = next(c for c in kc["contexts"] if c["name"] == kc["current-context"])["context"]
cluster = next(c for c in kc["clusters"] if c["name"] == ctx["cluster"])["cluster"]
user = next(u for u in kc["users"] if u["name"] == ctx["user"])["user"]
path = args[args.index("--raw") + 1]
tls = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
host, port = cluster["server"][len("https://"):].rsplit(":", 1)
import http.client
conn = http.client.HTTPSConnection(host, int(port), context=tls, timeout=10)
# Verify the certificate against tls-server-name, as kubectl does.
conn._tunnel_host = None
sock = __import__("socket").create_connection((host, int(port)), timeout=10)
conn.sock = tls.wrap_socket(sock, server_hostname=cluster["tls-server-name"])
conn.request("GET", path, headers={"Authorization": "Bearer " + user["token"]})
r = conn.getresponse()
body = r.read().decode()
print(body)
sys.exit(0 if r.status == 200 else 1)
"#;

fn broker_args(hub: &Hub, broker: &Broker) -> Vec<String> {
    vec![
        "--broker".into(),
        format!("https://{}", broker.client_tls_addr),
        "--broker-ca".into(),
        hub.pki.ca_path().display().to_string(),
        "--broker-server-name".into(),
        "localhost".into(),
    ]
}

/// Starts `tetherctl proxy connect` to the echo service of c1 with `broker` (the broker flags)
/// and moves distinct bytes through it: two connections one after the other, then three at
/// once (spread over the forward's connections to the broker), each more than one 256 KiB
/// chunk, the half-close passed on both ways.
fn forward_round_trips(broker: Vec<String>, echo_port: u16) -> anyhow::Result<()> {
    let mut c = Command::new(bin("tetherctl")?);
    c.args(["proxy", "connect", "c1", &format!("127.0.0.1:{echo_port}")])
        .args(["--local-port", "0"])
        .args(&broker)
        .env("TETHER_TOKEN", OPS_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = c.spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let forward = Guard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(20))?;
    assert!(
        line.starts_with("Forwarding from 127.0.0.1:"),
        "{broker:?}: {line}"
    );
    let local: std::net::SocketAddr = line
        .split_whitespace()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let round_trip = move |i: u8| -> anyhow::Result<()> {
        let mut s = std::net::TcpStream::connect(local)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let payload: Vec<u8> = (0..600 * 1024)
            .map(|b: u32| (b as u8).wrapping_add(i))
            .collect();
        s.write_all(&payload)?;
        s.shutdown(std::net::Shutdown::Write)?;
        let mut back = Vec::new();
        s.read_to_end(&mut back)?;
        assert_eq!(back.len(), payload.len(), "connection {i}");
        assert!(back == payload, "connection {i}: bytes differ");
        Ok(())
    };
    for i in 0..2u8 {
        round_trip(i)?;
    }
    let together: Vec<_> = (2..5u8)
        .map(|i| std::thread::spawn(move || round_trip(i)))
        .collect();
    for t in together {
        t.join().expect("round trip thread")?;
    }
    drop(forward);
    Ok(())
}

/// Runs `tetherctl proxy kubectl` with `kubectl`; returns (success, stdout, stderr).
fn run_kubectl(
    hub: &Hub,
    broker: &Broker,
    kubectl: &str,
    token_file: &std::path::Path,
) -> anyhow::Result<(bool, String, String)> {
    let mut c = Command::new(bin("tetherctl")?);
    c.args(["proxy", "kubectl", "--cluster", "c1", "--cluster-ca"])
        .arg(hub.pki.ca_path())
        .arg("--kube-token-file")
        .arg(token_file)
        .args(["--kubectl", kubectl])
        .args(broker_args(hub, broker))
        .args(["--", "get", "--raw", "/version"])
        .env("TETHER_TOKEN", OPS_TOKEN);
    let o = c.output()?;
    Ok((
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_connect_round_trip_and_kubectl_through_the_tunnel() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let api = FakeApiServer::start(&hub).await?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], api.addr, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;

    // proxy connect: a local port to the echo service inside c1, through the client TLS port
    // and through the plain port (HTTP/2 without TLS, bearer token).
    forward_round_trips(broker_args(&hub, &broker), echo.port())?;
    forward_round_trips(
        vec!["--broker".into(), format!("http://{}", broker.client_addr)],
        echo.port(),
    )?;
    // A client certificate cannot go over the plain port: the error says so before any dial.
    let o = Command::new(bin("tetherctl")?)
        .args(["proxy", "connect", "c1", "--local-port", "0", "--broker"])
        .arg(format!("http://{}", broker.client_addr))
        .args([
            "--client-cert",
            "/nonexistent.crt",
            "--client-key",
            "/nonexistent.key",
        ])
        .env_remove("TETHER_TOKEN")
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "a certificate over http:// was accepted"
    );
    assert!(err.contains("a client certificate needs https://"), "{err}");

    // proxy kubectl: the stand-in, then the real kubectl when it runs here.
    let token_file = hub.path().join("kube.token");
    std::fs::write(&token_file, KUBE_TOKEN)?;
    let fake = hub.path().join("fake-kubectl");
    std::fs::write(&fake, FAKE_KUBECTL)?;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755))?;
    let before = api.requests();
    let (ok, out, err) = run_kubectl(&hub, &broker, fake.to_str().unwrap(), &token_file)?;
    assert!(ok, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("v1.32.0-tether-test"), "{out}");
    assert!(api.requests() > before, "the API server saw no request");

    let real = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if real {
        let (ok, out, err) = run_kubectl(&hub, &broker, "kubectl", &token_file)?;
        assert!(ok, "kubectl: stdout: {out}\nstderr: {err}");
        assert!(out.contains("v1.32.0-tether-test"), "{out}");
    } else {
        eprintln!("kubectl not installed: only the stand-in ran");
    }

    // A wrong CA: TLS to the API server is verified, so kubectl fails.
    let other = tether_test_support::Pki::new(&hub.path().join("other-pki"))?;
    let mut c = Command::new(bin("tetherctl")?);
    c.args(["proxy", "kubectl", "--cluster", "c1", "--cluster-ca"])
        .arg(other.ca_path())
        .arg("--kube-token-file")
        .arg(&token_file)
        .args(["--kubectl", fake.to_str().unwrap()])
        .args(broker_args(&hub, &broker))
        .args(["--", "get", "--raw", "/version"])
        .env("TETHER_TOKEN", OPS_TOKEN);
    let o = c.output()?;
    assert!(!o.status.success(), "a foreign CA must fail verification");
    Ok(())
}

/// A hub with broker `b1` and cluster `c1` (API server: an echo server), once its tunnel is
/// up; the forwards name their targets themselves. Keep the agent alive while the tunnel is used.
async fn hub_with_c1() -> anyhow::Result<(Hub, Broker, tether_e2e::Agent)> {
    tether_e2e::with_c1(Hub::new()?).await
}

/// Starts `tetherctl proxy connect c1 <target>` over the broker's plain port (HTTP CONNECT,
/// bytes moved by the kernel), its stderr in `log`; its local address.
fn plain_forward(
    broker: &Broker,
    target: std::net::SocketAddr,
    log: &std::path::Path,
) -> anyhow::Result<(Guard, std::net::SocketAddr)> {
    let args = vec!["--broker".into(), format!("http://{}", broker.client_addr)];
    forward_with(&args, target, log)
}

/// Starts `tetherctl proxy connect c1 <target>` with the broker flags `broker`, its stderr in
/// `log`; its local address.
fn forward_with(
    broker: &[String],
    target: std::net::SocketAddr,
    log: &std::path::Path,
) -> anyhow::Result<(Guard, std::net::SocketAddr)> {
    let mut c = Command::new(bin("tetherctl")?);
    c.args(["proxy", "connect", "c1", &target.to_string()])
        .args(["--local-port", "0"])
        .args(broker)
        .env("TETHER_TOKEN", OPS_TOKEN)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log)?);
    let mut child = c.spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let guard = Guard(child);
    let local = line
        .split_whitespace()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    Ok((guard, local))
}

/// Connects to `local`, sends `first` and reads to the end: Ok(bytes) at a clean EOF, the
/// error otherwise (the outer error: no connection, or no end within 20 s).
async fn send_and_read_to_end(
    local: std::net::SocketAddr,
    first: &[u8],
) -> anyhow::Result<std::io::Result<usize>> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(local).await?;
    s.write_all(first).await?;
    let mut buf = Vec::new();
    Ok(tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf)).await?)
}

fn is_reset(end: &std::io::Result<usize>) -> bool {
    end.as_ref()
        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset)
}

/// Through the plain port the forward keeps every ending's meaning: the broker's refusal is
/// printed with its reason and the local client is reset; a target's reset reaches the local
/// client as a reset, not as a clean EOF after lost bytes; a clean close after a large answer
/// delivers every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_connect_over_the_plain_port_keeps_refusals_and_resets() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (hub, broker, _agent) = hub_with_c1().await?;

    // A refused target: nothing listens there.
    let closed = tether_e2e::RefusedAddr::new()?;
    let log = hub.path().join("forward-refused.log");
    let (_fwd, local) = plain_forward(&broker, closed.addr, &log)?;
    let end = send_and_read_to_end(local, b"early bytes").await?;
    assert!(
        is_reset(&end),
        "a refused dial ended the local connection with {end:?}"
    );
    let text = tether_test_support::wait_until(
        Duration::from_secs(20),
        "the forward prints the broker's refusal",
        || {
            std::fs::read_to_string(&log)
                .ok()
                .filter(|t| t.contains("the broker refused"))
        },
    )?;
    assert!(text.contains("502 Bad Gateway (refused)"), "{text}");

    // A target that answers, then resets.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut t, _)) = l.accept().await {
            let mut first = [0u8; 4];
            if t.read_exact(&mut first).await.is_err() {
                continue;
            }
            let answer = vec![first[0]; 300 * 1024];
            let _ = t.write_all(&answer).await;
            if &first == b"rst!" {
                let _ = t.set_zero_linger();
            }
            // Dropped: RST with zero linger, FIN otherwise.
        }
    });
    let log = hub.path().join("forward-reset.log");
    let (_fwd, local) = plain_forward(&broker, target, &log)?;
    let end = send_and_read_to_end(local, b"rst!").await?;
    assert!(
        is_reset(&end),
        "the target's reset reached the local client as {end:?}"
    );
    // The same target closing cleanly: all 300 KiB arrive, then EOF.
    let end = send_and_read_to_end(local, b"fin!").await?;
    assert_eq!(end?, 300 * 1024, "a clean close lost bytes");
    Ok(())
}

/// A local client that half-closes during a download and then goes away ends the target's
/// connection promptly through either port: the forward resets the tunnel stream instead of
/// draining what a streaming target (a log follower, a watch) keeps sending for a client that
/// is gone. Over the TLS port the SDK would otherwise read on, discarding, for up to
/// `LINGER_AFTER_SHUTDOWN` (30 s) after the local client's EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_whose_client_goes_away_mid_download_ends_the_target() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (hub, broker, _agent) = hub_with_c1().await?;

    // A target that streams until a write fails, then reports it.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    let (ended_tx, mut ended_rx) = tokio::sync::mpsc::channel::<std::io::Error>(4);
    tokio::spawn(async move {
        while let Ok((mut t, _)) = l.accept().await {
            let ended = ended_tx.clone();
            tokio::spawn(async move {
                let chunk = vec![0x5au8; 64 * 1024];
                loop {
                    if let Err(e) = t.write_all(&chunk).await {
                        let _ = ended.send(e).await;
                        return;
                    }
                }
            });
        }
    });

    for (name, args) in [
        ("tls", broker_args(&hub, &broker)),
        (
            "plain",
            vec!["--broker".into(), format!("http://{}", broker.client_addr)],
        ),
    ] {
        let log = hub.path().join(format!("forward-gone-{name}.log"));
        let (_fwd, local) = forward_with(&args, target, &log)?;
        let mut s = tokio::net::TcpStream::connect(local).await?;
        let mut buf = vec![0u8; 256 * 1024];
        let mut got = 0;
        while got < (1 << 20) {
            let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await??;
            anyhow::ensure!(n > 0, "{name}: the download ended after {got} bytes");
            got += n;
        }
        // Half-close, then go away with the download still running.
        s.shutdown().await?;
        drop(s);
        let e = tokio::time::timeout(Duration::from_secs(10), ended_rx.recv())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "{name}: the target was still streaming 10 s after the local client went away"
                )
            })?
            .expect("the target server runs");
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{name}: the target's connection ended with {e}"
        );
    }
    Ok(())
}
