//! The example automation (`examples/automation/auto_accept_and_alert.py`, NATS only) against a
//! live hub: real nats-server, addon-manager, registration-agents, a broker, a tunnel-agent and a
//! health-prober on NATS.
//!
//! - a cluster whose claims and labels match the rule is accepted by the script (it joins);
//!   one that does not match stays pending;
//! - when the accepted cluster's tunnel-agent stops, the prober's health event makes the script
//!   print an alert.
//!
//! Needs `nats-py` (scripts/install-deps.sh). Run:
//! `cargo build -p addon-manager -p tetherctl -p registration-agent -p health-prober -p tunnel-broker -p tunnel-agent --bins && cargo test -p tether-e2e --test automation`.

use tether_e2e::registration;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use registration::{Hub as NatsHub, HubOpts, read_log, tail};
use tether_e2e::apiserver::FakeApiServer;
use tether_e2e::{Hub as TunnelHub, wait_agent_ready, wait_tunnel};
use tether_test_support::{Child, bin, wait_until};

const WAIT: Duration = Duration::from_secs(30);

fn registration_agent(hub: &NatsHub, cluster: &str, extra: &[&str]) -> anyhow::Result<Child> {
    let boot = hub.dir.join(format!("{cluster}.bootstrap.kubeconfig"));
    hub.join(&boot, &hub.server_url(), &hub.token, None, None)?;
    let mut c = Command::new(bin("registration-agent")?);
    c.args(["--cluster-name", cluster])
        .arg("--bootstrap-kubeconfig")
        .arg(&boot)
        .arg("--hub-kubeconfig-dir")
        .arg(hub.dir.join(format!("{cluster}-creds")))
        .args(["--check-interval", "200ms"])
        .args(extra)
        .env("RUST_LOG", "info,async_nats=warn");
    Child::spawn(&format!("agent-{cluster}"), c, &hub.logs)
}

fn wait_log(dir: &Path, name: &str, needle: &str) -> anyhow::Result<()> {
    wait_until(WAIT, &format!("{name}.log: {needle:?}"), || {
        read_log(dir, name).contains(needle).then_some(())
    })
    .map_err(|e| anyhow::anyhow!("{e}\n{name}.log:\n{}", tail(&read_log(dir, name), 30)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_automation_accepts_matching_clusters_and_alerts_on_probe_failure()
-> anyhow::Result<()> {
    let has_nats_py = Command::new("python3")
        .args(["-c", "import nats"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        has_nats_py,
        "python3 with nats-py is needed: run scripts/install-deps.sh"
    );
    let hub = NatsHub::start(HubOpts::default())?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/automation/auto_accept_and_alert.py");
    let mut c = Command::new("python3");
    c.arg("-u")
        .arg(&script)
        .arg("--hub-dir")
        .arg(&hub.hub_dir)
        .args(["--nats-url", &hub.nats_url()])
        .args(["--claim", "platform=k3s", "--label", "env=dev*"]);
    let _automation = Child::spawn("automation", c, &hub.logs)?;
    wait_log(
        &hub.logs,
        "automation",
        "auto-accept: watching for new clusters",
    )?;
    wait_log(&hub.logs, "automation", "alerts: watching health events")?;

    // Auto-accept: "edge" matches the rule, "other" does not.
    let _edge = registration_agent(
        &hub,
        "edge",
        &["--claim", "platform=k3s", "--label", "env=dev-1"],
    )?;
    let _other = registration_agent(
        &hub,
        "other",
        &["--claim", "platform=eks", "--label", "env=dev-1"],
    )?;
    wait_log(&hub.logs, "automation", "ACCEPTED cluster edge")?;
    hub.wait_condition("edge", "ManagedClusterJoined", "True", WAIT)?;
    wait_log(
        &hub.logs,
        "automation",
        "auto-accept: other does not match the rule",
    )?;
    let other = hub.cluster("other").expect("other exists (pending)");
    assert_eq!(other["spec"]["hubAcceptsClient"], false, "{other}");
    assert!(!read_log(&hub.logs, "automation").contains("ACCEPTED cluster other"));

    // Alerting: edge is probed healthy through its tunnel; its tunnel-agent stops → alert.
    let th = TunnelHub::new()?;
    let api = FakeApiServer::start(&th).await?;
    let broker = th.start_broker("b1", "")?;
    let mut agent = th.start_agent("edge", "edge", &[vec![broker.agent_addr]], api.addr, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "edge").await?;
    let prober = th.start_prober(
        &broker,
        &[],
        &format!(
            "interval: 500ms\ntimeout: 400ms\nfailure_threshold: 1\nnats:\n  hub_dir: {}\n  url: {}\n",
            hub.hub_dir.display(),
            hub.nats_url()
        ),
    )?;
    wait_until(WAIT, "edge probed healthy", || {
        let rows = hub
            .tetherctl_ok(&["proxy", "health", "--cluster", "edge", "-o", "json"])
            .ok()?;
        rows.contains("\"probedHealth\": \"True\"").then_some(())
    })?;
    assert!(
        !read_log(&hub.logs, "automation").contains("ALERT cluster edge"),
        "alert before any failure:\n{}",
        read_log(&hub.logs, "automation")
    );
    agent.child.kill();
    wait_log(&hub.logs, "automation", "ALERT cluster edge probe failed")?;
    println!("{}", tail(&read_log(&hub.logs, "automation"), 10));
    drop(prober);
    Ok(())
}
