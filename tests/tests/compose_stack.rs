//! The compose stack (`compose/compose.yaml`) for real, on the machine's Docker engine (issue 11).
//!
//! One test, in order: `scripts/build-images.sh` (images from a debootstrapped base, the
//! binaries this `cargo test` run built), `docker compose up -d --wait` under a project name of
//! its own (`tether-ci-<pid>`), then through the running stack:
//! 1. `tetherctl proxy health -o json` (in the addon-manager container) lists edge-1 and edge-2
//!    INSTALLED/AVAILABLE/PROBED HEALTH True/True/True;
//! 2. a client on this host reaches each cluster's web service (`web.default.svc:8080`, only
//!    reachable inside the cluster) by plain CONNECT through each broker's published port;
//! 3. from inside each cluster's agent container, hub NATS and the brokers are unreachable
//!    directly (by IP) and hub names do not resolve; edge-1 reaches NATS through its squid
//!    (CONNECT answered 200); both squids' access logs show the agents' CONNECTs to NATS; every
//!    connection to the brokers' agent port comes from a squid (or the peer broker's relay);
//! 4. Prometheus has the alert rules loaded and every Grafana panel of
//!    `observability/grafana/tether.json` gets data from at least one of its queries;
//! 5. with broker-b1 stopped, both clusters are still reached through broker-b2, and both
//!    squids have logged the agents' (now ended) CONNECTs to broker-b1;
//! 6. `docker compose down -v` leaves no container, network or volume of the project.
//!
//! A Drop guard runs `down -v` whatever happens. Without a Docker engine (`docker info` fails)
//! the test prints why and passes without doing anything.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::Value;

const CLUSTERS: [&str; 2] = ["edge-1", "edge-2"];
/// `up --wait` includes registration of both clusters (agents are ready once joined).
const UP_TIMEOUT: Duration = Duration::from_secs(600);
/// Probes run every 10 s; two rounds and the add-on lease are well inside this.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(180);
/// Prometheus scrapes every 5 s; rates need two samples after the traffic.
const PANELS_TIMEOUT: Duration = Duration::from_secs(120);
const IO_TIMEOUT: Duration = Duration::from_secs(10);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Runs a command with a deadline; the child is killed when it passes.
fn run(cmd: &mut Command, timeout: Duration) -> anyhow::Result<Output> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {what}"))?;
    // Drain the pipes on threads so a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().context("stdout")?;
    let mut err = child.stderr.take().context("stderr")?;
    let t_out = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = out.read_to_end(&mut b);
        b
    });
    let t_err = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = err.read_to_end(&mut b);
        b
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    })
}

/// Like [`run`], failing (with its output) on a non-zero exit.
fn run_ok(cmd: &mut Command, timeout: Duration) -> anyhow::Result<String> {
    let what = format!("{cmd:?}");
    let o = run(cmd, timeout)?;
    ensure!(
        o.status.success(),
        "{what}: {}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

fn docker_answers() -> Result<(), String> {
    match run(
        Command::new("docker").args(["info", "--format", "{{.ServerVersion}}"]),
        Duration::from_secs(20),
    ) {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// A compose project of this test, with its own tag of the Tether image (the engine may be
/// shared with other runs); `down -v` and the tag removed on drop.
struct Stack {
    project: String,
    file: PathBuf,
    image: String,
}

impl Stack {
    fn compose(&self) -> Command {
        let mut c = Command::new("docker");
        c.arg("compose")
            .arg("-p")
            .arg(&self.project)
            .arg("-f")
            .arg(&self.file)
            .env("TETHER_IMAGE", &self.image)
            .current_dir(root());
        c
    }

    fn compose_ok(&self, args: &[&str], timeout: Duration) -> anyhow::Result<String> {
        run_ok(self.compose().args(args), timeout)
    }

    /// `tetherctl ...` in the addon-manager container (it holds the hub directory).
    fn tetherctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["exec", "-T", "addon-manager", "tetherctl"];
        full.extend_from_slice(args);
        full.extend_from_slice(&["--hub-dir", "/etc/tether/hub"]);
        self.compose_ok(&full, Duration::from_secs(60))
    }

    /// `127.0.0.1:<port>` a service's container port is published on.
    fn published(&self, service: &str, port: u16) -> anyhow::Result<String> {
        let out = self.compose_ok(&["port", service, &port.to_string()], IO_TIMEOUT)?;
        let addr = out.trim().to_string();
        ensure!(
            addr.starts_with("127.0.0.1:"),
            "{service}:{port} published on {addr:?}"
        );
        Ok(addr)
    }

    /// `bash -c SCRIPT` in a service's container; exit status and output.
    fn sh(&self, service: &str, script: &str) -> anyhow::Result<Output> {
        run(
            self.compose()
                .args(["exec", "-T", service, "bash", "-c", script]),
            Duration::from_secs(30),
        )
    }

    /// A service's address on the hub network.
    fn hub_ip(&self, service: &str) -> anyhow::Result<String> {
        let format = format!(
            "{{{{(index .NetworkSettings.Networks \"{}_hub\").IPAddress}}}}",
            self.project
        );
        let container = format!("{}-{service}-1", self.project);
        let ip = run_ok(
            Command::new("docker").args(["inspect", "-f", &format, &container]),
            IO_TIMEOUT,
        )?;
        let ip = ip.trim().to_string();
        ensure!(!ip.is_empty(), "{service} has no hub address");
        Ok(ip)
    }

    /// Remote IPv4 addresses of the established TCP connections to `port` in a service's
    /// container (its /proc/net/tcp).
    fn established_peers(&self, service: &str, port: u16) -> anyhow::Result<Vec<String>> {
        let table =
            self.compose_ok(&["exec", "-T", service, "cat", "/proc/net/tcp"], IO_TIMEOUT)?;
        let local_port = format!("{port:04X}");
        let mut out = Vec::new();
        for line in table.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(remote), Some(state)) = (f.get(1), f.get(2), f.get(3)) else {
                continue;
            };
            // State 01 is ESTABLISHED.
            if *state != "01" || local.rsplit_once(':').map(|(_, p)| p) != Some(local_port.as_str())
            {
                continue;
            }
            let hex = remote.split_once(':').map(|(ip, _)| ip).unwrap_or_default();
            let n = u32::from_str_radix(hex, 16).with_context(|| format!("address {hex}"))?;
            // /proc/net/tcp prints the address in host (little-endian) byte order.
            out.push(std::net::Ipv4Addr::from(n.swap_bytes()).to_string());
        }
        Ok(out)
    }

    /// squid-`cluster`'s access log has a successful CONNECT to `target`.
    fn squid_connected(&self, cluster: &str, target: &str) -> anyhow::Result<()> {
        let squid = format!("squid-{cluster}");
        let log = self.compose_ok(
            &["exec", "-T", &squid, "cat", "/var/log/squid/access.log"],
            IO_TIMEOUT,
        )?;
        let connect = format!("CONNECT {target} ");
        ensure!(
            log.lines()
                .any(|l| l.contains("TCP_TUNNEL/200") && l.contains(&connect)),
            "{squid} access log has no successful CONNECT {target}:\n{log}"
        );
        Ok(())
    }

    /// The project's containers, networks and volumes still on the engine.
    fn leftovers(&self) -> anyhow::Result<Vec<String>> {
        let label = format!("label=com.docker.compose.project={}", self.project);
        let mut left = Vec::new();
        for kind in [
            &["ps", "-a", "-q"][..],
            &["network", "ls", "-q"],
            &["volume", "ls", "-q"],
        ] {
            let out = run_ok(
                Command::new("docker").args(kind).args(["--filter", &label]),
                IO_TIMEOUT,
            )?;
            left.extend(out.lines().map(|l| format!("{} {l}", kind[0])));
        }
        Ok(left)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = run(
            self.compose()
                .args(["down", "-v", "--remove-orphans", "--timeout", "5"]),
            Duration::from_secs(180),
        );
        let _ = run(
            Command::new("docker").args(["rmi", &self.image]),
            Duration::from_secs(60),
        );
    }
}

fn wait_for<T>(
    timeout: Duration,
    what: &str,
    mut cond: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last;
    loop {
        match cond() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => last = "not yet".into(),
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}; last: {last}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// HTTP/1.0 request over a fresh TCP connection; the whole answer as text.
fn http(addr: &str, request: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    s.write_all(request.as_bytes())?;
    let mut b = Vec::new();
    s.read_to_end(&mut b)?;
    Ok(String::from_utf8_lossy(&b).into_owned())
}

/// Through a broker's plain CONNECT port (bearer token): `GET /` of `target` in `cluster`.
/// Returns the status line of the CONNECT answer and, after a 200, the body of the GET.
fn via_broker(broker: &str, token: &str, cluster: &str, target: &str) -> anyhow::Result<String> {
    let (host, port) = target.rsplit_once(':').context("host:port")?;
    let authority = format!("{host}.{cluster}.tether:{port}");
    let mut s = TcpStream::connect(broker).with_context(|| format!("connect {broker}"))?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.write_all(
        format!(
            "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: Bearer {token}\r\n\r\n"
        )
        .as_bytes(),
    )?;
    // The CONNECT answer ends with an empty line; read byte by byte so no tunnel data is lost.
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        ensure!(
            s.read(&mut byte)? == 1,
            "broker closed during the CONNECT answer"
        );
        head.push(byte[0]);
        ensure!(head.len() < 8192, "CONNECT answer too long");
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head.lines().next().unwrap_or_default().to_string();
    if !status.contains(" 200") {
        return Ok(status);
    }
    s.write_all(format!("GET / HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())?;
    let mut b = Vec::new();
    s.read_to_end(&mut b)?;
    let text = String::from_utf8_lossy(&b).into_owned();
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.trim().to_string())
        .unwrap_or(text))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET /api/v1/<path>` of the stack's Prometheus; the `data` field.
fn prometheus(addr: &str, path_and_query: &str) -> anyhow::Result<Value> {
    let answer = http(
        addr,
        &format!("GET /api/v1/{path_and_query} HTTP/1.0\r\nHost: prometheus\r\n\r\n"),
    )?;
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    let v: Value = serde_json::from_str(body).with_context(|| format!("answer: {answer}"))?;
    ensure!(v["status"] == "success", "{path_and_query}: {v}");
    Ok(v["data"].clone())
}

/// A panel query as Grafana would send it, with the dashboard's interval variables filled in
/// (a window long enough to cover the stack's start).
fn panel_query(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "10m")
}

#[test]
fn compose_stack_end_to_end() -> anyhow::Result<()> {
    if let Err(why) = docker_answers() {
        println!(
            "SKIPPED compose_stack_end_to_end: no Docker engine answers (`docker info`: {why})"
        );
        return Ok(());
    }
    let started = Instant::now();
    let tetherctl = tether_test_support::bin("tetherctl")?;
    let bin_dir = tetherctl.parent().context("binary directory")?;

    let run_id = format!("tether-ci-{}", std::process::id());
    let stack = Stack {
        file: root().join("compose/compose.yaml"),
        image: format!("tether:{run_id}"),
        project: run_id,
    };

    // Images: the debootstrapped bases are cached across runs; the Tether image from the
    // binaries of this build, under this run's tag.
    let t = Instant::now();
    run_ok(
        Command::new("bash")
            .arg(root().join("scripts/build-images.sh"))
            .env("TETHER_BIN_DIR", bin_dir)
            .env("TETHER_IMAGE", &stack.image)
            .current_dir(root()),
        Duration::from_secs(1200),
    )?;
    let build_time = t.elapsed();

    let t = Instant::now();
    stack.compose_ok(
        &[
            "up",
            "-d",
            "--wait",
            "--wait-timeout",
            &UP_TIMEOUT.as_secs().to_string(),
        ],
        UP_TIMEOUT + Duration::from_secs(60),
    )?;
    let up_time = t.elapsed();

    // 1. proxy health: True/True/True for both clusters.
    let rows = wait_for(HEALTHY_TIMEOUT, "edge-1 and edge-2 True/True/True", || {
        let out = stack.tetherctl(&["proxy", "health", "-o", "json"])?;
        let v: Value = serde_json::from_str(&out)?;
        let items = v["items"].as_array().context("items")?.clone();
        let healthy = CLUSTERS.iter().all(|c| {
            items.iter().any(|r| {
                r["clusterName"] == *c
                    && r["installed"] == true
                    && r["available"] == "True"
                    && r["probedHealth"] == "True"
            })
        });
        Ok(healthy.then_some(items))
    })?;
    let healthy_time = t.elapsed();
    println!("proxy health: {}", serde_json::to_string(&rows)?);

    // 2. A hub client with a token, allowed the clusters' web services.
    let token = stack
        .tetherctl(&["client", "create", "ops", "--token"])?
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.contains(' '))
        .context("token in `client create` output")?
        .to_string();
    let policy = "apiVersion: proxy.tether.io/v1alpha1\nkind: ClientAccessPolicy\nmetadata: {name: ops-web}\nspec:\n  clients: [ops]\n  rules:\n    - clusters: [\"edge-*\"]\n      targets: [apiserver, \"web.default.svc:*\"]\n";
    let apply = format!("printf '%s' '{policy}' | tetherctl apply -f - --hub-dir /etc/tether/hub");
    stack.compose_ok(
        &["exec", "-T", "addon-manager", "sh", "-c", &apply],
        Duration::from_secs(60),
    )?;
    let b1 = stack.published("broker-b1", 8080)?;
    let b2 = stack.published("broker-b2", 8080)?;
    for broker in [&b1, &b2] {
        for c in CLUSTERS {
            let body = wait_for(Duration::from_secs(60), "the web service", || {
                let body = via_broker(broker, &token, c, "web.default.svc:8080")?;
                Ok(body.contains("hello from").then_some(body))
            })?;
            assert_eq!(body, format!("hello from {c}"), "through {broker}");
        }
    }
    // A dial failure for the dashboard's failure panels: a port nothing listens on.
    let refused = via_broker(&b1, &token, "edge-1", "web.default.svc:9")?;
    assert!(!refused.contains(" 200"), "{refused}");

    // 3. The clusters reach the hub only through their squid.
    let hub_ips = [stack.hub_ip("nats")?, stack.hub_ip("broker-b1")?];
    for c in CLUSTERS {
        let agent = format!("agent-{c}");
        for (ip, port) in [(&hub_ips[0], 4222), (&hub_ips[1], 8091)] {
            let o = stack.sh(
                &agent,
                &format!("timeout 5 bash -c '</dev/tcp/{ip}/{port}' 2>&1"),
            )?;
            assert!(
                !o.status.success(),
                "{agent} reached {ip}:{port} directly: {}",
                String::from_utf8_lossy(&o.stdout)
            );
        }
        let o = stack.sh(
            &agent,
            "for n in nats broker-b1 broker-b2; do timeout 5 getent hosts $n; done",
        )?;
        assert!(
            String::from_utf8_lossy(&o.stdout).trim().is_empty(),
            "{agent} resolves hub names: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    let o = stack.sh(
        "agent-edge-1",
        "exec 3<>/dev/tcp/squid/3128 && printf 'CONNECT nats:4222 HTTP/1.1\\r\\nHost: nats:4222\\r\\n\\r\\n' >&3 && timeout 5 head -n 1 <&3",
    )?;
    let line = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        line.contains(" 200"),
        "CONNECT nats:4222 through squid: {line:?}"
    );
    // squid logs a CONNECT when it ends: the agents' NATS connections of registration have.
    for c in CLUSTERS {
        stack.squid_connected(c, "nats:4222")?;
    }
    // The brokers' agent tunnels (port 8091) all come from the squids' hub-side addresses
    // (or from the peer broker's relay connection).
    let squid_ips: Vec<String> = CLUSTERS
        .iter()
        .map(|c| stack.hub_ip(&format!("squid-{c}")))
        .collect::<anyhow::Result<_>>()?;
    for (broker, peer) in [("broker-b1", "broker-b2"), ("broker-b2", "broker-b1")] {
        let peer_ip = stack.hub_ip(peer)?;
        let remotes = wait_for(Duration::from_secs(30), "tunnels from both squids", || {
            let r = stack.established_peers(broker, 8091)?;
            Ok(squid_ips.iter().all(|ip| r.contains(ip)).then_some(r))
        })?;
        for r in &remotes {
            assert!(
                squid_ips.contains(r) || *r == peer_ip,
                "{broker}:8091 has a connection from {r}, neither a squid ({squid_ips:?}) nor {peer} ({peer_ip})"
            );
        }
    }

    // 4. Prometheus: rules loaded, every dashboard panel has data.
    let prom = stack.published("prometheus", 9090)?;
    let rules = prometheus(&prom, "rules?type=alert")?;
    let loaded: usize = rules["groups"]
        .as_array()
        .context("rule groups")?
        .iter()
        .map(|g| g["rules"].as_array().map_or(0, Vec::len))
        .sum();
    let alerts_file = std::fs::read_to_string(root().join("observability/prometheus/alerts.yml"))?;
    assert_eq!(
        loaded,
        alerts_file.matches("- alert:").count(),
        "alert rules loaded"
    );
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(
        root().join("observability/grafana/tether.json"),
    )?)?;
    let panels = dashboard["panels"].as_array().context("panels")?;
    let mut pending: Vec<(String, Vec<String>)> = panels
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| {
            let exprs = p["targets"]
                .as_array()
                .map(|t| {
                    t.iter()
                        .filter_map(|t| t["expr"].as_str().map(panel_query))
                        .collect()
                })
                .unwrap_or_default();
            (p["title"].as_str().unwrap_or("?").to_string(), exprs)
        })
        .collect();
    let panel_count = pending.len();
    wait_for(PANELS_TIMEOUT, "data for every dashboard panel", || {
        let mut still = Vec::new();
        for (title, exprs) in pending.drain(..) {
            let mut has_data = false;
            for e in &exprs {
                let data = prometheus(&prom, &format!("query?query={}", urlencode(e)))?;
                if data["result"].as_array().is_some_and(|r| !r.is_empty()) {
                    has_data = true;
                    break;
                }
            }
            if !has_data {
                still.push((title, exprs));
            }
        }
        let done = still.is_empty();
        if !done {
            eprintln!(
                "panels without data yet: {:?}",
                still.iter().map(|s| &s.0).collect::<Vec<_>>()
            );
        }
        pending = still;
        Ok(done.then_some(()))
    })?;

    // 5. One broker down: both clusters through the other.
    stack.compose_ok(&["stop", "broker-b1"], Duration::from_secs(90))?;
    // Its tunnels ended, so each squid has logged the agents' CONNECT to it.
    for c in CLUSTERS {
        wait_for(
            Duration::from_secs(30),
            "squid logging the tunnel to broker-b1",
            || Ok(stack.squid_connected(c, "broker-b1:8091").ok()),
        )?;
    }
    ensure!(
        TcpStream::connect(&b1).is_err()
            || via_broker(&b1, &token, "edge-1", "web.default.svc:8080").is_err(),
        "broker-b1 still answers after stop"
    );
    for c in CLUSTERS {
        let body = wait_for(
            Duration::from_secs(60),
            "web service through broker-b2",
            || {
                let body = via_broker(&b2, &token, c, "web.default.svc:8080")?;
                Ok(body.contains("hello from").then_some(body))
            },
        )?;
        assert_eq!(body, format!("hello from {c}"));
    }

    // 6. down -v leaves nothing behind.
    stack.compose_ok(
        &["down", "-v", "--remove-orphans", "--timeout", "5"],
        Duration::from_secs(180),
    )?;
    let left = stack.leftovers()?;
    assert!(left.is_empty(), "left behind by down -v: {left:?}");

    let sizes = run_ok(
        Command::new("docker").args([
            "image",
            "ls",
            "--format",
            "{{.Repository}}:{{.Tag}} {{.Size}}",
        ]),
        IO_TIMEOUT,
    )?;
    println!(
        "compose stack: images built in {build_time:.1?}; up --wait {up_time:.1?}; both clusters True/True/True {healthy_time:.1?} after up; {panel_count} panels with data; total {:.1?}",
        started.elapsed()
    );
    for l in sizes.lines().filter(|l| {
        (l.starts_with("tether") && !l.starts_with("tether:")) || l.starts_with(&stack.image)
    }) {
        println!("image {l}");
    }
    Ok(())
}
