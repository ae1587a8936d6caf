//! Isolation on the bus: a cluster's credentials work only on its own subjects, the bootstrap
//! credential can only register, CSRs are validated, pending CSRs are capped and a denied
//! cluster's certificate is refused.
//!
//! Run: `cargo build --workspace --bins && cargo test -p tether-e2e --test registration_isolation`.

use tether_e2e::registration;

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use registration::*;
use tether_control::connect::{self, CertMaterial, ConnectConfig, Credentials};
use tether_control::kubeconfig::{HubEndpoint, Token};
use tether_control::resources::{CsrReply, CsrSubmit, LeaseRenew, LeaseReply, rfc3339};
use tether_control::{ControlError, subjects};
use tether_test_support::wait_until_async;

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

fn endpoint(creds: &Path) -> HubEndpoint {
    tether_control::kubeconfig::parse_hub_endpoint(&read(&creds.join("kubeconfig")), "kubeconfig")
        .unwrap()
}

fn material(creds: &Path, user_override: Option<String>) -> Arc<RwLock<CertMaterial>> {
    let cert_pem = read(&creds.join("tls.crt"));
    let info = tether_pki::CertInfo::from_pem(&cert_pem).unwrap();
    Arc::new(RwLock::new(CertMaterial {
        cert_pem,
        key: tether_pki::AgentKey::from_pem(&read(&creds.join("tls.key"))).unwrap(),
        user: user_override.unwrap_or(info.common_name),
    }))
}

async fn connect_as(
    ep: &HubEndpoint,
    creds: Credentials,
) -> Result<tether_control::NatsConnection, ControlError> {
    let mut cfg = ConnectConfig::new(ep.clone(), creds, "test");
    cfg.request_timeout = Duration::from_millis(800);
    connect::connect(&cfg).await
}

fn lease(agent: &str) -> LeaseRenew {
    LeaseRenew {
        agent_name: agent.into(),
        lease_duration_seconds: 2,
        cluster_claims: vec![],
        agent_time: rfc3339(std::time::SystemTime::now()),
    }
}

async fn wait_violation(conn: &tether_control::NatsConnection, needle: &str) {
    wait_until_async(
        Duration::from_secs(5),
        &format!("server error containing {needle:?}"),
        || async {
            conn.recent_errors()
                .iter()
                .any(|e| e.contains(needle))
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: saw {:?}", conn.recent_errors()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_are_isolated_on_the_bus() {
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["iso-*".into()],
        ..Default::default()
    })
    .unwrap();
    let boot = hub.dir.join("boot");
    hub.join(&boot, &hub.server_url(), &hub.token, None, None)
        .unwrap();
    let creds_a = hub.dir.join("creds-a");
    let creds_b = hub.dir.join("creds-b");
    let _a = start_agent(&hub.logs, "agent-a", "iso-a", &boot, &creds_a, None).unwrap();
    let _b = start_agent(&hub.logs, "agent-b", "iso-b", &boot, &creds_b, None).unwrap();
    for n in ["agent-a", "agent-b"] {
        wait_log(&hub.logs, n, "joined the hub", START_TIMEOUT).unwrap();
    }
    let agent_a = read(&creds_a.join("agent-name")).trim().to_string();
    let ep = endpoint(&creds_a);

    // Cluster A's credentials: its own lease works …
    let conn = connect_as(&ep, Credentials::Cert(material(&creds_a, None)))
        .await
        .unwrap();
    let r: LeaseReply = connect::request_json(
        &conn.client,
        subjects::cluster_lease("iso-a"),
        &lease(&agent_a),
    )
    .await
    .unwrap();
    assert!(r.accepted);
    // … B's subjects are refused by the server.
    let err = connect::request_json::<_, LeaseReply>(
        &conn.client,
        subjects::cluster_lease("iso-b"),
        &lease(&agent_a),
    )
    .await
    .unwrap_err();
    println!("publish on B's subject: {err}");
    wait_violation(
        &conn,
        "Permissions Violation for Publish to \"tether.v1.cluster.iso-b.lease\"",
    )
    .await;
    let _sub = conn
        .client
        .subscribe("tether.v1.cluster.iso-b.>")
        .await
        .unwrap();
    wait_violation(
        &conn,
        "Permissions Violation for Subscription to \"tether.v1.cluster.iso-b.>\"",
    )
    .await;
    let _sub2 = conn.client.subscribe("_INBOX.>").await.unwrap();
    wait_violation(
        &conn,
        "Permissions Violation for Subscription to \"_INBOX.>\"",
    )
    .await;

    // A's certificate claiming to be B is refused at connect.
    let b_cn = tether_pki::CertInfo::from_pem(&read(&creds_b.join("tls.crt")))
        .unwrap()
        .common_name;
    let err = connect_as(&ep, Credentials::Cert(material(&creds_a, Some(b_cn))))
        .await
        .unwrap_err();
    assert!(err.is_unauthorized(), "{err}");
    assert!(read_log(&hub.logs, "addon-manager").contains("does not match certificate CN"));

    // The bootstrap credential can register and nothing else.
    let boot_conn = connect_as(&ep, Credentials::Bootstrap(Token::new(hub.token.clone())))
        .await
        .unwrap();
    let _ = connect::request_json::<_, LeaseReply>(
        &boot_conn.client,
        subjects::cluster_lease("iso-a"),
        &lease("x"),
    )
    .await;
    wait_violation(
        &boot_conn,
        "Permissions Violation for Publish to \"tether.v1.cluster.iso-a.lease\"",
    )
    .await;
    let _s = boot_conn.client.subscribe("tether.v1.>").await.unwrap();
    wait_violation(
        &boot_conn,
        "Permissions Violation for Subscription to \"tether.v1.>\"",
    )
    .await;
    let _ = boot_conn.client.publish("$JS.API.INFO", "".into()).await;
    wait_violation(
        &boot_conn,
        "Permissions Violation for Publish to \"$JS.API.INFO\"",
    )
    .await;

    // CSR validation: a CSR whose subject names another cluster is rejected.
    let key = tether_pki::AgentKey::generate().unwrap();
    let other = tether_pki::create_csr(&key, "iso-b", "evil").unwrap();
    let err = connect::request_json::<_, CsrReply>(
        &boot_conn.client,
        subjects::bootstrap_csr("iso-c"),
        &CsrSubmit {
            cluster_name: "iso-c".into(),
            agent_name: "evil".into(),
            csr: other,
            cluster_claims: vec![],
            labels: Default::default(),
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("CSR subject rejected"), "{err}");

    // Pending CSRs are capped per cluster (not auto-accepted: name does not match iso-*).
    let mut refused = None;
    for i in 0..11 {
        let key = tether_pki::AgentKey::generate().unwrap();
        let csr = tether_pki::create_csr(&key, "capped", &format!("a{i}")).unwrap();
        let r = connect::request_json::<_, CsrReply>(
            &boot_conn.client,
            subjects::bootstrap_csr("capped"),
            &CsrSubmit {
                cluster_name: "capped".into(),
                agent_name: format!("a{i}"),
                csr,
                cluster_claims: vec![],
                labels: Default::default(),
            },
        )
        .await;
        match r {
            Ok(reply) => assert!(i < 10, "CSR {i} accepted: {reply:?}"),
            Err(e) => refused = Some((i, e.to_string())),
        }
    }
    let (i, msg) = refused.expect("the 11th CSR is refused");
    assert_eq!(i, 10);
    assert!(msg.contains("too many pending CSRs"), "{msg}");

    // Deny B: its certificate no longer opens a connection. Read it first: once denied, B's
    // agent notices and bootstraps again, removing its hub credentials.
    let b_material = material(&creds_b, None);
    hub.tetherctl_ok(&["deny", "iso-b"]).unwrap();
    let err = connect_as(&ep, Credentials::Cert(b_material))
        .await
        .unwrap_err();
    assert!(err.is_unauthorized(), "{err}");
}
