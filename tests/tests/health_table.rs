//! `tetherctl proxy health` against a live hub: real nats-server + addon-manager (the
//! `cluster-proxy` add-on installed on every accepted cluster), real brokers and the real
//! add-on chain, and a health-prober on NATS (cluster list from the hub, results in KV
//! `tether-health`, transitions as events, answers `tether.v1.health.get` from memory).
//!
//! The main test runs, per cluster, a `registration-agent --addon cluster-proxy` that joins the
//! hub through a forward proxy (tinyproxy; bootstrap kubeconfig from `tetherctl join`, accepted
//! with `tetherctl accept`), obtains the add-on credentials, fetches its config (the
//! ClusterManagementAddOn, AddOnDeploymentConfig with the proxy and ManagedProxyConfiguration
//! applied with `tetherctl apply -f`; the broker announces itself through its `control_plane`
//! section) and supervises a real tunnel-agent, whose tunnel goes through the same proxy. The
//! registration-agent renews the add-on lease with the tunnel-agent's connected brokers;
//! AVAILABLE is the hub's verdict on that lease — nothing is renewed on the agents' behalf.
//!
//! Three clusters: `ok` (healthy), `down` (agent up, API server down: PROBED HEALTH False) and
//! `stopped` (its registration-agent gets SIGTERM by PID and stops its tunnel-agent: PROBED
//! HEALTH False within one probe interval, AVAILABLE False — or Unknown once the cluster lease
//! lapses too — when its 1 s add-on lease lapses, 5 × 1 s after the last renewal).
//!
//! The other tests start tunnel-agents from static config and look at PROBED HEALTH only; the
//! ignored 1,000-cluster measurement simulates the clusters (see its doc).
//!
//! Run: `cargo build -p addon-manager -p tetherctl -p health-prober -p registration-agent -p tunnel-broker -p tunnel-agent --bins && cargo test -p tether-e2e --test health_table`.

use tether_e2e::registration;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use registration::{Hub as NatsHub, HubOpts, read_log, tail};
use tether_control::connect::{self, ConnectConfig, Credentials};
use tether_control::hub::{ADMIN_USER, HubDir};
use tether_control::store::Store as _;
use tether_control::subjects;
use tether_e2e::apiserver::FakeApiServer;
use tether_e2e::control_plane::{
    AddonAgent, AddonAgentSpec, broker_control_plane_yaml, cluster_proxy_resources, join,
    tunnel_hub_from_ca,
};
use tether_e2e::forward_proxy::Tinyproxy;
use tether_e2e::{Hub as TunnelHub, wait_agent_ready, wait_tunnel};
use tether_test_support::{wait_until, wait_until_async};

const WAIT: Duration = Duration::from_secs(40);
const INTERVAL: Duration = Duration::from_secs(1);

/// An admin NATS connection to the hub (as tetherctl has).
pub async fn admin_connection(hub: &NatsHub) -> anyhow::Result<tether_control::NatsConnection> {
    let dir = HubDir::load(&hub.hub_dir)?;
    let password = dir.read(&dir.config.nats.admin_password_file)?;
    let endpoint = dir.endpoint(Some(&hub.nats_url()))?;
    let cfg = ConnectConfig::new(
        endpoint,
        Credentials::HubUser {
            user: ADMIN_USER.into(),
            password: password.trim().to_string(),
        },
        "test",
    );
    Ok(connect::connect(&cfg).await?)
}

/// Runs `tetherctl events --watch --durable table-test -o json` until an event satisfies
/// `until`; returns the events it printed (JSON lines).
fn durable_watch(
    hub: &NatsHub,
    until: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<Vec<serde_json::Value>> {
    use std::io::BufRead as _;
    let mut child = std::process::Command::new(tether_test_support::bin("tetherctl")?)
        .args(["events", "--watch", "--durable", "table-test", "-o", "json"])
        .arg("--hub-dir")
        .arg(&hub.hub_dir)
        .args(["--nats-url", &hub.nats_url()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    let result = loop {
        let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) else {
            break Err(anyhow::anyhow!(
                "durable watch: no matching event; got {seen:?}"
            ));
        };
        let ev: serde_json::Value = serde_json::from_str(&line)?;
        let done = until(&ev);
        seen.push(ev);
        if done {
            break Ok(seen);
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    result
}

fn proxy_health(hub: &NatsHub, extra: &[&str]) -> anyhow::Result<String> {
    let mut args = vec!["proxy", "health"];
    args.extend_from_slice(extra);
    hub.tetherctl_ok(&args)
}

fn rows(hub: &NatsHub) -> Option<Vec<serde_json::Value>> {
    let out = proxy_health(hub, &["-o", "json"]).ok()?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    v["items"].as_array().cloned()
}

fn row<'a>(rows: &'a [serde_json::Value], c: &str) -> Option<&'a serde_json::Value> {
    rows.iter().find(|r| r["clusterName"] == c)
}

fn is(r: Option<&serde_json::Value>, installed: bool, available: &str, probed: &str) -> bool {
    r.is_some_and(|r| {
        r["installed"] == installed && r["available"] == available && r["probedHealth"] == probed
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_health_table_healthy_target_down_and_agent_stopped() -> anyhow::Result<()> {
    let hub = NatsHub::start(HubOpts::default())?;

    // Data plane on the hub CA: one broker announcing itself to the hub, the API server
    // stand-in, and an address where nothing listens (down's API server).
    let th = tunnel_hub_from_ca(&hub.hub_dir)?;
    let broker = th.start_broker(
        "b1",
        &broker_control_plane_yaml(&hub.hub_dir, &hub.nats_url(), &hub.opts.hub_host),
    )?;
    let api = FakeApiServer::start(&th).await?;
    let closed = tether_e2e::RefusedAddr::new()?;

    // The clusters' only way out: a forward proxy, for joining and for the tunnels.
    let proxy = Tinyproxy::start(&hub.logs, "proxy")?;
    let resources = hub.dir.join("cluster-proxy.yaml");
    std::fs::write(
        &resources,
        cluster_proxy_resources(&proxy.url(), broker.agent_addr),
    )?;
    hub.tetherctl_ok(&["apply", "-f", resources.to_str().unwrap()])?;

    let mut agents = Vec::new();
    for (c, apiserver) in [
        ("ok", api.addr),
        ("down", closed.addr),
        ("stopped", api.addr),
    ] {
        let boot = hub.dir.join(format!("{c}.bootstrap.kubeconfig"));
        join(&hub.hub_dir, &boot, &hub.server_url(), Some(&proxy.url()))?;
        agents.push(AddonAgent::start(&AddonAgentSpec {
            cluster: c,
            bootstrap: &boot,
            base: &hub.dir.join(c),
            apiserver: &apiserver.to_string(),
            lease_seconds: 1,
            netns: None,
            logs: &hub.logs,
        })?);
    }
    for c in ["ok", "down", "stopped"] {
        wait_until(WAIT, &format!("{c} asks to join"), || hub.cluster(c))?;
        hub.tetherctl_ok(&["accept", c])?;
    }
    let agent_log = |a: &AddonAgent| tail(&std::fs::read_to_string(&a.log).unwrap_or_default(), 30);
    for a in &agents {
        wait_tunnel(&broker, &a.cluster)
            .await
            .map_err(|e| anyhow::anyhow!("{e}\nagent log:\n{}", agent_log(a)))?;
    }
    // Every tunnel crossed the proxy.
    let to_broker = format!("CONNECT {}", broker.agent_addr);
    wait_until(WAIT, "three tunnel CONNECTs in the proxy log", || {
        (proxy
            .connects()
            .iter()
            .filter(|l| l.contains(&to_broker))
            .count()
            >= 3)
            .then_some(())
    })?;
    let admin = admin_connection(&hub).await?;

    // The prober takes its cluster list from the hub (no static clusters).
    let prober = th.start_prober(
        &broker,
        &[],
        &format!(
            "interval: {}ms\ntimeout: 800ms\nfailure_threshold: 1\nprober_id: prober-test\nnats:\n  hub_dir: {}\n  url: {}\n",
            INTERVAL.as_millis(),
            hub.hub_dir.display(),
            hub.nats_url()
        ),
    )?;
    let prober_log = || tail(&read_log(th.path(), "health-prober"), 20);

    let first = wait_until_async(
        WAIT,
        "table: ok healthy, down unhealthy, stopped healthy",
        || async {
            let r = rows(&hub)?;
            (is(row(&r, "ok"), true, "True", "True")
                && is(row(&r, "down"), true, "True", "False")
                && is(row(&r, "stopped"), true, "True", "True"))
            .then_some(r)
        },
    )
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "{e}\nlast table:\n{:?}\nprober log:\n{}",
            proxy_health(&hub, &["-o", "wide"]),
            prober_log()
        )
    })?;
    let r_ok = row(&first, "ok").unwrap();
    assert!(r_ok["latency"]["totalMs"].as_f64().is_some(), "{r_ok}");
    assert!(r_ok["latency"]["tunnelMs"].as_f64().is_some(), "{r_ok}");
    assert_eq!(r_ok["reason"], "ProbeSucceeded");
    let r_down = row(&first, "down").unwrap();
    assert_eq!(r_down["reason"], "TargetUnreachable", "{r_down}");
    assert!(r_down.get("latency").is_none(), "{r_down}");

    // The table for people, and the wide one.
    let table = proxy_health(&hub, &[])?;
    println!("{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("CLUSTER NAME")
            && ["INSTALLED", "AVAILABLE", "PROBED HEALTH", "LATENCY"]
                .iter()
                .all(|c| lines[0].contains(c)),
        "{table}"
    );
    let cells = |name: &str| -> Vec<String> {
        lines
            .iter()
            .find(|l| l.starts_with(name))
            .map(|l| l.split_whitespace().map(String::from).collect())
            .unwrap_or_default()
    };
    assert_eq!(cells("ok")[1..4], ["True", "True", "True"], "{table}");
    assert!(cells("ok")[4].ends_with("ms"), "{table}");
    assert_eq!(
        cells("down")[1..5],
        ["True", "True", "False", "-"],
        "{table}"
    );
    let wide = proxy_health(&hub, &["-o", "wide"])?;
    let head = wide.lines().next().unwrap();
    assert!(
        ["TUNNEL", "TARGET", "REASON", "PROBED AT"]
            .iter()
            .all(|c| head.contains(c)),
        "{wide}"
    );
    assert!(wide.contains("TargetUnreachable"), "{wide}");
    let yaml = proxy_health(&hub, &["--cluster", "ok", "-o", "yaml"])?;
    assert!(
        yaml.contains("clusterName: ok") && !yaml.contains("clusterName: down"),
        "{yaml}"
    );

    // Answered from memory: no probing on demand.
    let t = Instant::now();
    proxy_health(&hub, &["-o", "json"])?;
    let answered_in = t.elapsed();
    assert!(
        answered_in < Duration::from_secs(2),
        "proxy health took {answered_in:?}"
    );

    // `tetherctl events --watch` on the health subjects, started before the failure.
    let mut watch = std::process::Command::new(tether_test_support::bin("tetherctl")?)
        .args([
            "events",
            "--watch",
            "--limit",
            "0",
            "--subject",
            "tether.v1.events.health.>",
            "-o",
            "json",
        ])
        .arg("--hub-dir")
        .arg(&hub.hub_dir)
        .args(["--nats-url", &hub.nats_url()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    for pipe in [
        Box::new(watch.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
        Box::new(watch.stderr.take().expect("stderr")),
    ] {
        let tx = lines_tx.clone();
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    let watching = lines.recv_timeout(WAIT)?;
    assert!(
        watching.starts_with("watching tether.v1.events.health.>"),
        "{watching}"
    );

    // Stop one cluster's agent for real: SIGTERM to its registration-agent (by PID), which
    // stops its tunnel-agent; nobody renews its add-on lease any more.
    let mut stopped = agents.pop().expect("three agents");
    assert_eq!(stopped.cluster, "stopped");
    assert!(stopped.tunnel_agent_pid().is_some(), "no tunnel-agent runs");
    let t = Instant::now();
    stopped.stop(WAIT)?;
    let killed = Instant::now();
    println!(
        "stopped: registration-agent and its tunnel-agent gone {:?} after SIGTERM",
        t.elapsed()
    );
    wait_until_async(WAIT, "stopped: PROBED HEALTH False", || async {
        let r = rows(&hub)?;
        (row(&r, "stopped")?["probedHealth"] == "False").then_some(())
    })
    .await?;
    let probed_after = killed.elapsed();
    // One interval until the next round, plus the probe itself and the tetherctl round trip.
    assert!(
        probed_after <= INTERVAL + Duration::from_millis(1500),
        "PROBED HEALTH took {probed_after:?} (interval {INTERVAL:?})"
    );
    let last = wait_until_async(
        WAIT,
        "stopped: AVAILABLE False or Unknown (add-on lease lapsed)",
        || async {
            let r = rows(&hub)?;
            let s = row(&r, "stopped")?;
            (s["probedHealth"] == "False"
                && matches!(s["available"].as_str(), Some("False" | "Unknown")))
            .then_some(r)
        },
    )
    .await?;
    println!(
        "stopped: AVAILABLE {} {:?} after its agent stopped",
        row(&last, "stopped").unwrap()["available"],
        killed.elapsed()
    );
    assert_eq!(row(&last, "stopped").unwrap()["reason"], "NoTunnel");
    assert!(is(row(&last, "ok"), true, "True", "True"), "{last:?}");
    assert!(is(row(&last, "down"), true, "True", "False"), "{last:?}");
    let addon: serde_json::Value = serde_json::from_str(&hub.tetherctl_ok(&[
        "get",
        "addons",
        "stopped",
        "cluster-proxy",
        "-o",
        "json",
    ])?)?;
    let available = addon["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Available"))
        .cloned()
        .unwrap_or_default();
    println!("stopped: add-on {available}");
    // The agent's tunnels and its add-on lease end together; whichever the hub sees first
    // (broker presence without the cluster, the lease lapsing, the cluster going Unknown)
    // names the reason.
    assert!(
        [
            "ProxyAgentNotConnected",
            "ManagedClusterAddOnLeaseUpdateStopped",
            "ClusterUnknown"
        ]
        .contains(&available["reason"].as_str().unwrap_or_default()),
        "{addon}"
    );
    assert_ne!(available["status"], "True", "{addon}");
    println!("{}", proxy_health(&hub, &["-o", "wide"])?);

    // The watch printed the transition as it happened (one JSON object per line).
    let deadline = Instant::now() + WAIT;
    let seen = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left)?;
        if let Ok(ev) = serde_json::from_str::<serde_json::Value>(&line)
            && ev["involvedObject"]["name"] == "stopped"
        {
            break ev;
        }
    };
    assert_eq!(seen["reason"], "ClusterProbeFailed", "{seen}");
    let _ = watch.kill();
    let _ = watch.wait();

    // A durable consumer resumes where it stopped: the first run reads the history up to the
    // health event, the second starts after what the first acknowledged.
    let first_run = durable_watch(&hub, |ev| {
        ev["involvedObject"]["name"] == "stopped" && ev["reason"] == "ClusterProbeFailed"
    })?;
    hub.tetherctl_ok(&["accept", "brand-new"])?;
    let second_run = durable_watch(&hub, |ev| ev["involvedObject"]["name"] == "brand-new")?;
    let first_event = &first_run[0];
    assert!(
        !second_run[..second_run.len() - 1].contains(first_event) || first_run.len() == 1,
        "the durable consumer started over:\nfirst run: {first_run:?}\nsecond run: {second_run:?}"
    );
    assert!(
        second_run.len() < first_run.len(),
        "second run re-read the history: {second_run:?}"
    );

    // Results are in KV, the transition is an event, the prober answers requests directly.
    let js = async_nats::jetstream::new(admin.client.clone());
    let kv = js.get_key_value(subjects::BUCKET_HEALTH).await?;
    let rec: serde_json::Value =
        serde_json::from_slice(&kv.get("down").await?.expect("down in tether-health"))?;
    assert_eq!(rec["healthy"], false);
    assert_eq!(rec["prober"], "prober-test");
    let events = hub.tetherctl_ok(&[
        "events",
        "stopped",
        "--subject",
        "tether.v1.events.health.>",
        "-o",
        "json",
    ])?;
    assert!(events.contains("ClusterProbeFailed"), "{events}");
    let reply: serde_json::Value = connect::request_json(
        &admin.client,
        subjects::HEALTH_GET.into(),
        &serde_json::json!({"cluster": "ok"}),
    )
    .await?;
    assert_eq!(reply["prober"], "prober-test");
    assert_eq!(
        reply["clusters"].as_array().map(Vec::len),
        Some(1),
        "{reply}"
    );
    let (_, metrics) = tether_e2e::admin_get(prober.admin_addr, "/metrics").await?;
    assert!(
        metrics.contains("tether_prober_nats_published_total{kind=\"kv\",result=\"ok\"}"),
        "{metrics}"
    );
    Ok(())
}

/// Processes kept running for a test (dropped: stopped).
type Running = (tether_e2e::Agent, FakeApiServer);

/// A hub with cluster `ok` accepted, and one broker carrying `ok`'s tunnel to an API server
/// stand-in. Bound as `let (hub, th, broker, _running)`, they drop in reverse: the agent and
/// the API server first, the hub last.
async fn one_cluster() -> anyhow::Result<(NatsHub, TunnelHub, tether_e2e::Broker, Running)> {
    let hub = NatsHub::start(HubOpts::default())?;
    hub.tetherctl_ok(&["accept", "ok"])?;
    let th = TunnelHub::new()?;
    let api = FakeApiServer::start(&th).await?;
    let broker = th.start_broker("b1", "")?;
    let agent = th.start_agent("ok", "ok", &[vec![broker.agent_addr]], api.addr, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "ok").await?;
    Ok((hub, th, broker, (agent, api)))
}

/// Prober YAML: 500 ms rounds, the cluster list and results on `hub`'s NATS.
fn fast_prober_on(hub: &NatsHub) -> String {
    format!(
        "interval: 500ms\ntimeout: 400ms\nnats:\n  hub_dir: {}\n  url: {}\n",
        hub.hub_dir.display(),
        hub.nats_url()
    )
}

/// After a NATS restart the prober re-creates its (memory) bucket, keeps answering, and picks up
/// clusters accepted afterwards (its KV watch is re-opened).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prober_recovers_after_nats_restart() -> anyhow::Result<()> {
    let (mut hub, th, broker, _running) = one_cluster().await?;
    let _prober = th.start_prober(&broker, &[], &fast_prober_on(&hub))?;
    let kv_has = |hub: &NatsHub, cluster: &'static str| {
        let url = hub.nats_url();
        let dir = hub.hub_dir.clone();
        async move {
            let d = HubDir::load(&dir).ok()?;
            let password = d.read(&d.config.nats.admin_password_file).ok()?;
            let conn = connect::connect(&ConnectConfig::new(
                d.endpoint(Some(&url)).ok()?,
                Credentials::HubUser {
                    user: ADMIN_USER.into(),
                    password: password.trim().to_string(),
                },
                "test",
            ))
            .await
            .ok()?;
            let js = async_nats::jetstream::new(conn.client.clone());
            let kv = js.get_key_value(subjects::BUCKET_HEALTH).await.ok()?;
            kv.get(cluster).await.ok()?.map(|_| ())
        }
    };
    wait_until_async(WAIT, "ok probed healthy and in KV", || async {
        let r = rows(&hub)?;
        (row(&r, "ok")?["probedHealth"] == "True").then_some(())?;
        kv_has(&hub, "ok").await
    })
    .await?;

    hub.stop_nats()?;
    hub.start_nats()?;
    wait_until_async(
        WAIT,
        "health record back in KV after the restart",
        || async { kv_has(&hub, "ok").await },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", tail(&read_log(th.path(), "health-prober"), 20)))?;
    assert!(
        read_log(th.path(), "health-prober").contains("re-created the tether-health bucket"),
        "{}",
        tail(&read_log(th.path(), "health-prober"), 20)
    );
    // The addon-manager reconnects to the restarted NATS on its own schedule: until it has
    // re-subscribed, `accept` finds no responders. Retry until it answers.
    wait_until(
        WAIT,
        "addon-manager answers accept after the restart",
        || hub.tetherctl_ok(&["accept", "late"]).ok(),
    )?;
    wait_until_async(
        WAIT,
        "cluster accepted after the restart is probed",
        || async {
            let r = rows(&hub)?;
            (row(&r, "ok")?["probedHealth"] == "True"
                && row(&r, "late")?["probedHealth"] == "False")
                .then_some(())
        },
    )
    .await?;
    Ok(())
}

/// A prober started before the broker and hub NATS are reachable waits for them (jittered
/// retries, `/readyz` naming what it waits for) instead of exiting, then probes and publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prober_started_before_broker_and_nats_waits_for_them() -> anyhow::Result<()> {
    let (mut hub, th, broker, _running) = one_cluster().await?;
    // The broker is "down" (a relay that drops every connection), NATS stopped.
    let gate = tether_e2e::live::CutRelay::start_closed(broker.client_tls_addr).await?;
    hub.stop_nats()?;
    let mut prober = th.start_prober_via(gate.addr, &[], &fast_prober_on(&hub))?;
    let prober_log = || tail(&read_log(th.path(), "health-prober"), 20);
    let not_ready_with = |needle: &'static str| {
        let admin = prober.admin_addr;
        move || async move {
            let (status, body) = tether_e2e::admin_get(admin, "/readyz").await.ok()?;
            (status == 503 && body.contains(needle)).then_some(())
        }
    };
    // Waiting for the broker: several attempts, not ready, still running.
    wait_until_async(WAIT, "prober not ready, waiting for the broker", || async {
        (gate.accepted() >= 3).then_some(())?;
        not_ready_with("connecting to the broker")().await
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", prober_log()))?;
    assert!(prober.child.try_wait().is_none(), "{}", prober_log());
    assert!(
        read_log(th.path(), "health-prober").contains("cannot connect to the broker"),
        "{}",
        prober_log()
    );
    // The broker comes up: now it waits for NATS.
    gate.open();
    wait_until_async(
        WAIT,
        "prober not ready, waiting for hub NATS",
        not_ready_with("connecting to hub NATS"),
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", prober_log()))?;
    wait_until(WAIT, "a failed attempt on NATS logged", || {
        read_log(th.path(), "health-prober")
            .contains("cannot reach hub NATS")
            .then_some(())
    })?;
    assert!(prober.child.try_wait().is_none(), "{}", prober_log());
    // NATS comes up: ready, the hub's cluster probed and published.
    hub.start_nats()?;
    wait_until_async(WAIT, "prober ready", || async {
        let (status, _) = tether_e2e::admin_get(prober.admin_addr, "/readyz")
            .await
            .ok()?;
        (status == 200).then_some(())
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", prober_log()))?;
    wait_until(WAIT, "ok probed healthy in the health table", || {
        let r = rows(&hub)?;
        (row(&r, "ok")?["probedHealth"] == "True").then_some(())
    })
    .map_err(|e| anyhow::anyhow!("{e}\n{}", prober_log()))?;
    Ok(())
}

/// Starts a health-prober named `id` on NATS (own config, log and ready file).
fn start_named_prober(
    th: &TunnelHub,
    broker: &tether_e2e::Broker,
    hub: &NatsHub,
    id: &str,
) -> anyhow::Result<tether_test_support::Child> {
    let token = th.path().join(format!("{id}.token"));
    std::fs::write(&token, tether_e2e::OPS_TOKEN)?;
    let cfg = th.path().join(format!("{id}.yaml"));
    std::fs::write(
        &cfg,
        format!(
            "broker:\n  endpoint: https://{}\n  server_name: localhost\n  ca: {ca}\n  token_file: {}\napiserver_ca: {ca}\ninterval: 500ms\ntimeout: 400ms\nprober_id: {id}\nnats:\n  hub_dir: {}\n  url: {}\n",
            broker.client_tls_addr,
            token.display(),
            hub.hub_dir.display(),
            hub.nats_url(),
            ca = th.pki.ca_path().display(),
        ),
    )?;
    let ready = th.path().join(format!("{id}.ready"));
    let mut c = std::process::Command::new(tether_test_support::bin("health-prober")?);
    c.arg("--config").arg(&cfg).arg("--ready-file").arg(&ready);
    let child = tether_test_support::Child::spawn(id, c, th.path())?;
    tether_test_support::read_ready_file(&ready, WAIT)?;
    Ok(child)
}

/// Several probers answer `tether.v1.health.get` as one queue group: each request gets one
/// answer, and both probers take requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probers_share_health_requests_as_a_queue_group() -> anyhow::Result<()> {
    let hub = NatsHub::start(HubOpts::default())?;
    hub.tetherctl_ok(&["accept", "c1"])?;
    let th = TunnelHub::new()?;
    let broker = th.start_broker("b1", "")?;
    let _p1 = start_named_prober(&th, &broker, &hub, "prober-1")?;
    let _p2 = start_named_prober(&th, &broker, &hub, "prober-2")?;
    let admin = admin_connection(&hub).await?;
    let answers = wait_until_async(WAIT, "answers from both probers", || async {
        let mut ids = BTreeSet::new();
        for _ in 0..40 {
            let r: serde_json::Value = connect::request_json(
                &admin.client,
                subjects::HEALTH_GET.into(),
                &serde_json::json!({"cluster": "c1"}),
            )
            .await
            .ok()?;
            // Each answer carries its prober's own (probed) record of c1.
            if r["clusters"][0]["cluster"] != "c1" {
                return None;
            }
            ids.insert(r["prober"].as_str()?.to_string());
        }
        (ids.len() == 2).then_some(ids)
    })
    .await?;
    assert_eq!(
        answers.into_iter().collect::<Vec<_>>(),
        ["prober-1", "prober-2"]
    );
    Ok(())
}

/// CPU seconds (user + system) of a process so far.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

/// The 1,000-cluster figure in docs/configuration.md: 1,000 accepted ManagedClusters on a live
/// hub; every probe is real (tunnel stream through the broker, TLS to an API server stand-in,
/// `GET /livez`, result put in KV), but the 1,000 names are carried by 4 real agents
/// (`targets.<name>.via_cluster`), since 1,000 agent processes do not fit on this machine.
/// This is a simulation of the clusters: no registration-agent or add-on runs (the clusters
/// are written to the hub's KV directly) and only PROBED HEALTH is measured, never AVAILABLE.
/// Prints round duration and CPU. `PROBER_SCALE_CLUSTERS`, `PROBER_SCALE_INTERVAL_MS` and
/// `TETHER_BIN_DIR` (release binaries) adjust it.
///
/// Run: `cargo test -p tether-e2e --test health_table -- --ignored --nocapture prober_scale`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; prints figures"]
async fn prober_scale_1000_clusters() -> anyhow::Result<()> {
    use tether_control::resources::ManagedCluster;
    use tether_control::store::{Bucket, HubStore};
    let n: usize = std::env::var("PROBER_SCALE_CLUSTERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let interval_ms: u64 = std::env::var("PROBER_SCALE_INTERVAL_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    const AGENTS: usize = 4;
    let hub = NatsHub::start(HubOpts::default())?;
    let admin = admin_connection(&hub).await?;
    let store = HubStore::open(admin.client.clone()).await?;
    let th = TunnelHub::new()?;
    let broker = th.start_broker("b1", "")?;
    let mut agents = Vec::new();
    let mut apis = Vec::new();
    for i in 0..AGENTS {
        let api = FakeApiServer::start(&th).await?;
        let name = format!("agent-{i}");
        let a = th.start_agent(&name, &name, &[vec![broker.agent_addr]], api.addr, "")?;
        wait_agent_ready(&a).await?;
        wait_tunnel(&broker, &name).await?;
        agents.push(a);
        apis.push(api);
    }
    let mut targets = String::from("targets:\n");
    for i in 0..n {
        let name = format!("sim-{i:04}");
        let mut mc = ManagedCluster::new(&name);
        mc.spec.hub_accepts_client = true;
        store.put(Bucket::Clusters, &name, &mc).await?;
        targets.push_str(&format!(
            "  {name}: {{host: localhost, port: {}, path: /livez, tls: true, via_cluster: agent-{}}}\n",
            apis[i % AGENTS].addr.port(),
            i % AGENTS
        ));
    }
    let prober = th.start_prober(
        &broker,
        &[],
        &format!(
            "interval: {interval_ms}ms\ntimeout: {}ms\nconnection_max_age: 1h\nnats:\n  hub_dir: {}\n  url: {}\n{targets}",
            interval_ms.min(5000),
            hub.hub_dir.display(),
            hub.nats_url()
        ),
    )?;
    let pid = prober.child.pid();
    let get_all = || async {
        connect::request_json::<_, serde_json::Value>(
            &admin.client,
            subjects::HEALTH_GET.into(),
            &serde_json::json!({}),
        )
        .await
        .ok()
    };
    // First round: every cluster dials its stream and does its TLS handshake.
    let t0 = Instant::now();
    wait_until_async(
        Duration::from_secs(120),
        "every cluster probed once",
        || async {
            let r = get_all().await?;
            let c = r["clusters"].as_array()?;
            (c.len() == n && c.iter().all(|h| h["healthy"] == true)).then_some(())
        },
    )
    .await?;
    println!(
        "first round (new streams + TLS) done within {:?}",
        t0.elapsed()
    );
    // Steady state: rounds over reused connections.
    let rounds = 3u32;
    let cpu0 = cpu_secs(pid);
    let broker_cpu0 = cpu_secs(broker.child.pid());
    let w0 = Instant::now();
    let probes = |r: &serde_json::Value| -> u64 {
        r["clusters"]
            .as_array()
            .map(|c| {
                c.iter()
                    .filter_map(|h| h["probes"].as_u64())
                    .min()
                    .unwrap_or(0)
            })
            .unwrap_or(0)
    };
    let start_probes = probes(&get_all().await.expect("reply"));
    let overrun_before = {
        let (_, m) = tether_e2e::admin_get(prober.admin_addr, "/metrics").await?;
        tether_e2e::sum_samples(&m, "tether_prober_rounds_overrun_total", &[])
    };
    wait_until_async(
        Duration::from_millis(interval_ms * (rounds as u64 + 2)),
        "steady rounds",
        || async { (probes(&get_all().await?) >= start_probes + rounds as u64).then_some(()) },
    )
    .await?;
    let wall = w0.elapsed().as_secs_f64();
    let rounds_done = probes(&get_all().await.expect("reply")) - start_probes;
    let cpu = cpu_secs(pid) - cpu0;
    let broker_cpu = cpu_secs(broker.child.pid()) - broker_cpu0;
    let (_, metrics) = tether_e2e::admin_get(prober.admin_addr, "/metrics").await?;
    let gauge = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .unwrap_or("?")
            .to_string()
    };
    let opened = gauge("tether_prober_connections_opened_total");
    let overrun = tether_e2e::sum_samples(&metrics, "tether_prober_rounds_overrun_total", &[])
        - overrun_before;
    println!(
        "{n} clusters, interval {interval_ms} ms: last round {} s; {rounds_done} steady rounds, overrun {overrun} (since start {}); streams opened {opened} (one per cluster); prober CPU {:.2} s over {wall:.1} s wall = {:.1}% of one core ({:.3} CPU-ms per probe); broker CPU {:.1}%; API server requests {}",
        gauge("tether_prober_round_duration_seconds"),
        gauge("tether_prober_rounds_overrun_total"),
        cpu,
        100.0 * cpu / wall,
        1000.0 * cpu / (n as f64 * rounds_done.max(1) as f64),
        100.0 * broker_cpu / wall,
        apis.iter().map(|a| a.requests()).sum::<u64>(),
    );
    assert_eq!(overrun, 0.0, "steady-state rounds overran the interval");
    Ok(())
}
