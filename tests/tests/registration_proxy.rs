//! Registration through forward proxies on loopback: joins, named errors with recovery,
//! re-bootstrap, rotation, lease grace, NATS restart.
//!
//! Real nats-server 2.15, addon-manager, registration-agent, squid and tinyproxy processes.
//! Run: `cargo build --workspace --bins && cargo test -p tether-e2e --test registration_proxy`.

use tether_e2e::registration;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use registration::*;
use tether_test_support::wait_until;

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The hub kubeconfig's proxy-url, if the kubeconfig exists and parses (it is rewritten during
/// a re-bootstrap).
fn hub_proxy_url(creds: &Path) -> Option<String> {
    tether_control::kubeconfig::parse_hub_endpoint(&read(&creds.join("kubeconfig")), "kubeconfig")
        .ok()?
        .proxy
        .map(|p| p.to_url_with_secret())
}

/// Reads the hub kubeconfig the agent wrote and returns (server, proxy-url, CA PEM).
fn hub_kubeconfig(creds: &Path) -> (String, Option<String>, String) {
    let ep = tether_control::kubeconfig::parse_hub_endpoint(
        &read(&creds.join("kubeconfig")),
        "kubeconfig",
    )
    .expect("hub kubeconfig parses");
    (
        ep.server,
        ep.proxy.map(|p| p.to_url_with_secret()),
        ep.ca_pem,
    )
}

/// Writes bootstrap kubeconfig `name` (in the hub directory) for this hub, naming `proxy`.
fn bootstrap(hub: &Hub, name: &str, proxy: Option<&Proxy>) -> PathBuf {
    let boot = hub.dir.join(name);
    let proxy_url = proxy.map(Proxy::url);
    hub.join(
        &boot,
        &hub.server_url(),
        &hub.token,
        proxy_url.as_deref(),
        None,
    )
    .unwrap();
    boot
}

/// Waits for `cluster` to be Available.
fn wait_available(hub: &Hub, cluster: &str) {
    hub.wait_condition(
        cluster,
        "ManagedClusterConditionAvailable",
        "True",
        START_TIMEOUT,
    )
    .unwrap();
}

fn wait_joined(hub: &Hub, agent: &AgentProc, cluster: &str) -> Duration {
    wait_log(&hub.logs, &agent.name, "joined the hub", START_TIMEOUT).unwrap();
    let t = agent.started.elapsed();
    hub.wait_condition(cluster, "ManagedClusterJoined", "True", START_TIMEOUT)
        .unwrap();
    wait_available(hub, cluster);
    t
}

#[test]
fn joins_through_tinyproxy_with_auto_accept() {
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["edge-*".into()],
        ..Default::default()
    })
    .unwrap();
    let proxy = loopback_tinyproxy(&hub.logs, "tinyproxy").unwrap();
    let boot = bootstrap(&hub, "bootstrap.kubeconfig", Some(&proxy));
    let creds = hub.dir.join("creds-edge-1");
    let agent = start_agent(&hub.logs, "agent-edge-1", "edge-1", &boot, &creds, None).unwrap();
    let t = wait_joined(&hub, &agent, "edge-1");
    println!(
        "start-to-Joined through tinyproxy with auto-accept: {} ms",
        t.as_millis()
    );
    assert!(t < Duration::from_secs(3), "took {t:?}");

    // Hub credentials: OCM's keys; the kubeconfig keeps server, CA and proxy-url.
    for k in [
        "kubeconfig",
        "tls.crt",
        "tls.key",
        "cluster-name",
        "agent-name",
    ] {
        assert!(creds.join(k).is_file(), "{k} missing");
    }
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(creds.join("tls.key"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let (server, proxy_url, ca) = hub_kubeconfig(&creds);
    assert_eq!(server, hub.server_url());
    assert_eq!(proxy_url.as_deref(), Some(proxy.url().as_str()));
    assert!(ca.contains(read(&hub.hub_dir.join("ca.crt")).trim()));
    let info = tether_pki::CertInfo::from_pem(&read(&creds.join("tls.crt"))).unwrap();
    let agent_name = read(&creds.join("agent-name"));
    assert_eq!(
        info.common_name,
        format!(
            "system:open-cluster-management:edge-1:{}",
            agent_name.trim()
        )
    );
    assert!(
        info.organizations
            .contains(&"system:open-cluster-management:managed-clusters".to_string())
    );

    // The traffic went through the proxy.
    let proxy_log = read_log(&hub.logs, "tinyproxy");
    assert!(
        proxy_log.contains("CONNECT"),
        "proxy log: {}",
        tail(&proxy_log, 10)
    );

    // `tetherctl get clusters` prints the kubectl-like table.
    let table = hub.tetherctl_ok(&["get", "clusters"]).unwrap();
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap()
        .split("   ")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(
        header,
        ["NAME", "HUB ACCEPTED", "JOINED", "AVAILABLE", "AGE"]
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(&row[..4], ["edge-1", "true", "True", "True"]);
    let yaml = hub
        .tetherctl_ok(&["get", "clusters", "-o", "yaml"])
        .unwrap();
    assert!(
        yaml.contains("cluster.open-cluster-management.io/v1"),
        "{yaml}"
    );
    let events = hub.tetherctl_ok(&["get", "events", "edge-1"]).unwrap();
    assert!(events.contains("ManagedClusterJoined"), "{events}");
}

#[test]
fn manual_accept_then_deny() {
    let hub = Hub::start(HubOpts::default()).unwrap();
    let boot = bootstrap(&hub, "bootstrap.kubeconfig", None);
    let creds = hub.dir.join("creds");
    let agent = start_agent(&hub.logs, "agent", "manual-1", &boot, &creds, None).unwrap();
    wait_log(
        &hub.logs,
        "agent",
        "tetherctl accept manual-1",
        START_TIMEOUT,
    )
    .unwrap();
    let mc = hub.cluster("manual-1").unwrap();
    assert_eq!(mc["spec"]["hubAcceptsClient"], false);
    assert!(!creds.join("tls.crt").exists());
    hub.tetherctl_ok(&["accept", "manual-1"]).unwrap();
    wait_joined(&hub, &agent, "manual-1");
    assert_eq!(
        hub.condition("manual-1", "HubAcceptedManagedCluster")
            .as_deref(),
        Some("True")
    );

    hub.tetherctl_ok(&["deny", "manual-1"]).unwrap();
    assert_eq!(
        hub.condition("manual-1", "HubAcceptedManagedCluster")
            .as_deref(),
        Some("False")
    );
    // The agent drops its credentials and waits to be accepted again (never stuck).
    wait_log(&hub.logs, "agent", "bootstrapping again", START_TIMEOUT).unwrap();
    wait_until(START_TIMEOUT, "credentials removed", || {
        (!creds.join("tls.crt").exists()).then_some(())
    })
    .unwrap();
    hub.tetherctl_ok(&["accept", "manual-1"]).unwrap();
    wait_until(START_TIMEOUT, "new credentials", || {
        creds.join("tls.crt").exists().then_some(())
    })
    .unwrap();
}

/// The agent of case `case` of [`named_errors_then_recovery`]: `agent-<case>` of cluster
/// `c-<case>`, bootstrapping from `boot-<case>`, credentials in `cr-<case>`.
fn case_agent(hub: &Hub, case: &str) -> AgentProc {
    let dir = &hub.dir;
    let (boot, creds) = (
        dir.join(format!("boot-{case}")),
        dir.join(format!("cr-{case}")),
    );
    let (agent, cluster) = (format!("agent-{case}"), format!("c-{case}"));
    start_agent(&hub.logs, &agent, &cluster, &boot, &creds, None).unwrap()
}

#[test]
fn named_errors_then_recovery() {
    let mut hub = Hub::start(HubOpts {
        auto_accept: vec!["*".into()],
        ..Default::default()
    })
    .unwrap();
    let server = hub.server_url();
    let logs = hub.logs.clone();
    let mut agents = Vec::new();

    // Proxy down: nothing listens on the proxy port yet.
    let down_port = free_port();
    let boot_down = hub.dir.join("boot-down");
    hub.join(
        &boot_down,
        &server,
        &hub.token,
        Some(&format!("http://127.0.0.1:{down_port}")),
        None,
    )
    .unwrap();
    agents.push(case_agent(&hub, "down"));

    // 407: squid requires basic auth, the proxy-url has no credentials.
    let auth = loopback_proxy(
        &logs,
        "squid-auth",
        ProxyKind::SquidAuth {
            user: "edge".into(),
            password: "s3cret".into(),
        },
    )
    .unwrap();
    let boot_407 = hub.dir.join("boot-407");
    hub.join(
        &boot_407,
        &server,
        &hub.token,
        Some(&auth.url_without_auth()),
        None,
    )
    .unwrap();
    agents.push(case_agent(&hub, "407"));

    // 403: squid refuses every CONNECT.
    let deny = loopback_proxy(&logs, "squid-deny", ProxyKind::SquidDenyAll).unwrap();
    let boot_403 = hub.dir.join("boot-403");
    hub.join(&boot_403, &server, &hub.token, Some(&deny.url()), None)
        .unwrap();
    agents.push(case_agent(&hub, "403"));

    // Wrong proxy CA: https proxy whose CA is not in the bundle.
    let https = loopback_proxy(&logs, "squid-https", ProxyKind::SquidHttps).unwrap();
    let boot_ca = hub.dir.join("boot-ca");
    hub.join(&boot_ca, &server, &hub.token, Some(&https.url()), None)
        .unwrap();
    agents.push(case_agent(&hub, "ca"));

    // Bootstrap kubeconfig without a CA.
    let boot_noca = hub.dir.join("boot-noca");
    hub.join(&boot_noca, &server, &hub.token, None, None)
        .unwrap();
    let text: String = read(&boot_noca)
        .lines()
        .filter(|l| {
            !l.contains("certificate-authority-data") && !l.trim_start().starts_with("LS0t")
        })
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&boot_noca, text).unwrap();
    agents.push(case_agent(&hub, "noca"));

    // Unknown and expired bootstrap tokens.
    let boot_tok = hub.dir.join("boot-tok");
    hub.join(
        &boot_tok,
        &server,
        "tether-bootstrap.nosuchid.aaaaaaaaaaaaaaaaaaaaaaaa",
        None,
        None,
    )
    .unwrap();
    agents.push(case_agent(&hub, "tok"));
    let expired = hub
        .tetherctl_ok(&["token", "create", "--ttl", "1s"])
        .unwrap();
    let created = Instant::now();
    let boot_exp = hub.dir.join("boot-exp");
    hub.join(&boot_exp, &server, expired.trim(), None, None)
        .unwrap();
    wait_until(Duration::from_secs(5), "token to expire", || {
        (created.elapsed() > Duration::from_millis(1100)).then_some(())
    })
    .unwrap();
    agents.push(case_agent(&hub, "exp"));

    let t = Duration::from_secs(15);
    wait_log(
        &logs,
        "agent-down",
        "proxy down: cannot connect to proxy",
        t,
    )
    .unwrap();
    wait_log(&logs, "agent-407", "requires authentication (407", t).unwrap();
    wait_log(&logs, "agent-403", "refused CONNECT", t).unwrap();
    assert!(read_log(&logs, "agent-403").contains("403"));
    wait_log(&logs, "agent-ca", "wrong proxy CA", t).unwrap();
    wait_log(&logs, "agent-noca", "bootstrap kubeconfig without a CA", t).unwrap();
    wait_log(
        &logs,
        "agent-tok",
        "hub refused the bootstrap credential",
        t,
    )
    .unwrap();
    wait_log(
        &logs,
        "agent-exp",
        "hub refused the bootstrap credential",
        t,
    )
    .unwrap();
    assert!(
        read_log(&logs, "addon-manager").contains("expired at"),
        "hub names the expiry"
    );
    // Passwords never reach logs.
    assert!(!read_log(&logs, "agent-407").contains("s3cret"));

    // Recovery without restarting the agents: bring the proxy up, fix the kubeconfigs.
    let _tiny = start_proxy(
        &logs,
        "tinyproxy",
        ProxyKind::Tinyproxy,
        "127.0.0.1",
        Some(down_port),
        &[],
        None,
    )
    .unwrap();
    wait_log(&logs, "agent-down", "joined the hub", START_TIMEOUT).unwrap();
    hub.join(&boot_407, &server, &hub.token, Some(&auth.url()), None)
        .unwrap();
    wait_log(&logs, "agent-407", "joined the hub", START_TIMEOUT).unwrap();
    hub.join(
        &boot_ca,
        &server,
        &hub.token,
        Some(&https.url()),
        https.ca_file.as_deref(),
    )
    .unwrap();
    wait_log(&logs, "agent-ca", "joined the hub", START_TIMEOUT).unwrap();
    hub.join(&boot_noca, &server, &hub.token, None, None)
        .unwrap();
    wait_log(&logs, "agent-noca", "joined the hub", START_TIMEOUT).unwrap();
    hub.join(&boot_tok, &server, &hub.token, None, None)
        .unwrap();
    wait_log(&logs, "agent-tok", "joined the hub", START_TIMEOUT).unwrap();

    // NATS down at start: the agent names it and joins once NATS is back.
    hub.stop_nats().unwrap();
    let boot_nats = hub.dir.join("boot-nats");
    hub.join(&boot_nats, &server, &hub.token, None, None)
        .unwrap();
    agents.push(case_agent(&hub, "nats"));
    wait_log(&logs, "agent-nats", "NATS down", t).unwrap();
    hub.start_nats().unwrap();
    wait_log(
        &logs,
        "agent-nats",
        "joined the hub",
        Duration::from_secs(30),
    )
    .unwrap();
    hub.wait_condition("c-nats", "ManagedClusterJoined", "True", START_TIMEOUT)
        .unwrap();
    drop(agents);
}

#[test]
fn rebootstrap_when_proxy_url_changes() {
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["*".into()],
        ..Default::default()
    })
    .unwrap();
    let a = loopback_tinyproxy(&hub.logs, "tinyproxy").unwrap();
    let b = loopback_proxy(&hub.logs, "squid", ProxyKind::SquidHttp).unwrap();
    let boot = bootstrap(&hub, "boot", Some(&a));
    let creds = hub.dir.join("creds");
    let agent = start_agent(&hub.logs, "agent", "moving", &boot, &creds, None).unwrap();
    wait_joined(&hub, &agent, "moving");
    let first_cert = read(&creds.join("tls.crt"));
    assert_eq!(hub_kubeconfig(&creds).1.as_deref(), Some(a.url().as_str()));

    hub.join(&boot, &hub.server_url(), &hub.token, Some(&b.url()), None)
        .unwrap();
    wait_log(
        &hub.logs,
        "agent",
        "bootstrap kubeconfig changed",
        START_TIMEOUT,
    )
    .unwrap();
    wait_until(
        START_TIMEOUT,
        "hub kubeconfig with the new proxy-url",
        || (hub_proxy_url(&creds).as_deref() == Some(b.url().as_str())).then_some(()),
    )
    .unwrap();
    assert_ne!(
        read(&creds.join("tls.crt")),
        first_cert,
        "new credentials after re-bootstrap"
    );
    wait_until(START_TIMEOUT, "squid to carry the agent", || {
        read(&b.dir.join("access.log"))
            .contains("CONNECT")
            .then_some(())
    })
    .unwrap();
    wait_available(&hub, "moving");
}

#[test]
fn rotates_before_expiry_and_goes_unknown_after_grace() {
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["*".into()],
        cert_lifetime: "20s".into(),
        lease_seconds: 1,
        grace_multiplier: 3,
        ..Default::default()
    })
    .unwrap();
    let boot = bootstrap(&hub, "boot", None);
    let creds = hub.dir.join("creds");
    let mut agent = start_agent(&hub.logs, "agent", "rot", &boot, &creds, None).unwrap();
    wait_joined(&hub, &agent, "rot");
    let first = tether_pki::CertInfo::from_pem(&read(&creds.join("tls.crt"))).unwrap();
    let life = first.not_after.duration_since(first.not_before).unwrap();
    // Rotation must happen when 20–25 % of the life is left, i.e. before expiry.
    let rotated = wait_until(Duration::from_secs(30), "certificate rotation", || {
        let c = tether_pki::CertInfo::from_pem(&read(&creds.join("tls.crt"))).ok()?;
        (c.serial_hex != first.serial_hex).then_some(c)
    })
    .unwrap();
    let at = std::time::SystemTime::now();
    assert!(at < first.not_after, "rotated before expiry");
    assert!(
        at.duration_since(first.issued_at()).unwrap() > life / 2,
        "rotated too soon after issuance"
    );
    let left = first.not_after.duration_since(at).unwrap().as_secs_f64() / life.as_secs_f64();
    println!(
        "rotated with {:.0}% of the certificate's life left",
        left * 100.0
    );
    assert!(left <= 0.26, "rotated too early ({left})");
    assert!(rotated.not_after > first.not_after);
    hub.wait_condition("rot", "ClusterCertificateRotated", "True", START_TIMEOUT)
        .unwrap();
    wait_available(&hub, "rot");

    // Agent stops: Available becomes Unknown after 3 × 1 s.
    agent.child.kill();
    let stopped = Instant::now();
    hub.wait_condition(
        "rot",
        "ManagedClusterConditionAvailable",
        "Unknown",
        Duration::from_secs(15),
    )
    .unwrap();
    let waited = stopped.elapsed();
    println!(
        "Available=Unknown {} ms after the agent stopped (grace 3 s)",
        waited.as_millis()
    );
    assert!(
        waited >= Duration::from_millis(1500),
        "too early: {waited:?}"
    );
    let wide = hub
        .tetherctl_ok(&["get", "clusters", "-o", "wide"])
        .unwrap();
    assert!(
        wide.contains("UNKNOWN IN") && wide.contains("now"),
        "{wide}"
    );
    // Back again with the stored credentials (no new CSR).
    let agent2 = start_agent(&hub.logs, "agent2", "rot", &boot, &creds, None).unwrap();
    wait_available(&hub, "rot");
    assert!(!read_log(&hub.logs, "agent2").contains("certificate issued"));
    drop(agent2);
}

#[test]
fn state_survives_nats_restart() {
    let mut hub = Hub::start(HubOpts {
        auto_accept: vec!["*".into()],
        lease_seconds: 1,
        ..Default::default()
    })
    .unwrap();
    let proxy = loopback_tinyproxy(&hub.logs, "tinyproxy").unwrap();
    let boot = bootstrap(&hub, "boot", Some(&proxy));
    let creds = hub.dir.join("creds");
    let agent = start_agent(&hub.logs, "agent", "persist", &boot, &creds, None).unwrap();
    wait_joined(&hub, &agent, "persist");
    let before = hub.cluster("persist").unwrap();
    hub.stop_nats().unwrap();
    hub.start_nats().unwrap();
    let after = hub.cluster("persist").unwrap();
    assert_eq!(before["metadata"]["uid"], after["metadata"]["uid"]);
    assert_eq!(after["spec"]["hubAcceptsClient"], true);
    // The agent and the hub reconnect by themselves; leases flow again.
    let renewals_before = read_log(&hub.logs, "agent")
        .matches("joined the hub")
        .count();
    wait_until(START_TIMEOUT, "lease renewed after restart", || {
        let out = hub.tetherctl_ok(&["get", "clusters", "-o", "wide"]).ok()?;
        let lease_age: u64 = out
            .lines()
            .nth(1)?
            .split_whitespace()
            .nth(5)?
            .trim_end_matches('s')
            .parse()
            .ok()?;
        (lease_age <= 1).then_some(())
    })
    .unwrap();
    wait_available(&hub, "persist");
    assert_eq!(renewals_before, 1);
    assert!(!read_log(&hub.logs, "agent").contains("bootstrapping again"));
}

#[test]
fn expired_credentials_trigger_rebootstrap() {
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["*".into()],
        cert_lifetime: "10s".into(),
        ..Default::default()
    })
    .unwrap();
    let boot = bootstrap(&hub, "boot", None);
    let creds = hub.dir.join("creds");
    let mut agent = start_agent(&hub.logs, "agent", "expiring", &boot, &creds, None).unwrap();
    wait_joined(&hub, &agent, "expiring");
    agent.child.kill();
    let cert = tether_pki::CertInfo::from_pem(&read(&creds.join("tls.crt"))).unwrap();
    wait_until(
        Duration::from_secs(20),
        "stored certificate to expire",
        || cert.is_expired(std::time::SystemTime::now()).then_some(()),
    )
    .unwrap();
    let _agent2 = start_agent(&hub.logs, "agent2", "expiring", &boot, &creds, None).unwrap();
    wait_log(&hub.logs, "agent2", "bootstrapping again", START_TIMEOUT).unwrap();
    wait_log(&hub.logs, "agent2", "joined the hub", START_TIMEOUT).unwrap();
    let fresh = tether_pki::CertInfo::from_pem(&read(&creds.join("tls.crt"))).unwrap();
    assert_ne!(fresh.serial_hex, cert.serial_hex);
    assert!(!fresh.is_expired(std::time::SystemTime::now()));
}
