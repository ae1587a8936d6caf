//! The add-on resources and their lifecycle on the hub, end to end: real nats-server, real
//! addon-manager, `tetherctl apply/get/delete`.
//!
//! - apply validates every document first: a bad one is named with its field and nothing of the
//!   file is stored;
//! - an accepted cluster gets its ManagedClusterAddOn with configReferences and spec hashes,
//!   Progressing=True until the agent reports the hashes applied; changing the
//!   AddOnDeploymentConfig changes the hash and makes it Progressing again;
//! - a cluster that stops matching the install strategy, or is deleted, loses its add-on;
//! - everything survives a NATS restart;
//! - Available follows the add-on lease, and an Unknown cluster makes its add-on Unknown.
//!
//! Run: `cargo build -p addon-manager -p tetherctl -p registration-agent --bins && cargo test -p tether-e2e --test addon_lifecycle`.

use tether_e2e::registration;

use std::time::Duration;

use anyhow::Context;
use registration::*;
use tether_control::connect::{self, ConnectConfig, Credentials};
use tether_control::hub::{ADMIN_USER, HubDir};
use tether_control::subjects;
use tether_e2e::addons::ClusterProxyAddOn;
use tether_test_support::wait_until;

const WAIT: Duration = Duration::from_secs(20);

/// The valid add-on: two proxy servers, a display name, keepalive 10 s.
fn good() -> String {
    ClusterProxyAddOn {
        display_name: Some("Cluster Proxy"),
        server_replicas: 2,
        entrypoints: &[
            ("broker-1.hub.example", Some(8091)),
            ("broker-2.hub.example", None),
        ],
        keepalive: "10s",
        ..Default::default()
    }
    .yaml()
}

fn write(hub: &Hub, name: &str, text: &str) -> String {
    let p = hub.dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

fn json(hub: &Hub, args: &[&str]) -> serde_json::Value {
    let out = hub.tetherctl_ok(args).unwrap();
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

fn addon(hub: &Hub, cluster: &str) -> Option<serde_json::Value> {
    hub.addon_json(cluster, "cluster-proxy")
}

fn cond(mca: &serde_json::Value, t: &str) -> Option<String> {
    mca["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)
        .and_then(|c| c["status"].as_str().map(str::to_string))
}

fn adc_hash(mca: &serde_json::Value) -> Option<String> {
    mca["status"]["configReferences"]
        .as_array()?
        .iter()
        .find(|r| r["resource"] == "addondeploymentconfigs")
        .and_then(|r| r["desiredConfig"]["specHash"].as_str().map(str::to_string))
}

/// Waits until the add-on of `cluster` satisfies `f`; returns it.
fn wait_addon(
    hub: &Hub,
    cluster: &str,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    wait_until(WAIT, what, || addon(hub, cluster).filter(|m| f(m)))
        .with_context(|| {
            format!(
                "add-on now: {:?}\naddon-manager log:\n{}",
                addon(hub, cluster),
                tail(&read_log(&hub.logs, "addon-manager"), 20)
            )
        })
        .unwrap()
}

fn stored_names(hub: &Hub) -> Vec<String> {
    let mut names = Vec::new();
    for what in ["configs", "clustermanagementaddons"] {
        let v = json(hub, &["get", what, "-o", "json"]);
        for i in v["items"].as_array().unwrap() {
            names.push(i["metadata"]["name"].as_str().unwrap().to_string());
        }
    }
    names
}

/// A request as the admin user on an add-on agent subject; the reply body (or the error).
fn admin_request(
    hub: &Hub,
    subject: String,
    body: serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    let dir = HubDir::load(&hub.hub_dir)?;
    let password = dir.read(&dir.config.nats.admin_password_file)?;
    let endpoint = dir.endpoint(Some(&hub.nats_url()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let cfg = ConnectConfig::new(
            endpoint,
            Credentials::HubUser {
                user: ADMIN_USER.into(),
                password: password.trim().to_string(),
            },
            "test",
        );
        let conn = connect::connect(&cfg).await?;
        Ok(connect::request_json::<_, serde_json::Value>(&conn.client, subject, &body).await?)
    })
}

/// Reports the add-on's desired hashes as applied, as the agent will
/// (`tether.v1.cluster.<c>.addon.<a>.status`).
fn report_applied(hub: &Hub, cluster: &str, mca: &serde_json::Value) {
    let applied: Vec<serde_json::Value> = mca["status"]["configReferences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            serde_json::json!({
                "group": r["group"], "resource": r["resource"],
                "namespace": r["namespace"].as_str().unwrap_or(""),
                "name": r["name"], "specHash": r["desiredConfig"]["specHash"],
            })
        })
        .collect();
    admin_request(
        hub,
        subjects::cluster_addon_status(cluster, "cluster-proxy"),
        serde_json::json!({ "appliedConfigs": applied }),
    )
    .unwrap();
}

fn reason(mca: &serde_json::Value, t: &str) -> String {
    mca["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == t))
        .and_then(|c| c["reason"].as_str())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn apply_validates_and_addon_follows_cluster_and_config() {
    let hub = Hub::start(HubOpts::default()).unwrap();

    // Bad input: one bad document in a file of valid ones; the field is named, nothing stored.
    let bad_port = good().replace(
        "- host: broker-2.hub.example",
        "- host: broker-2.hub.example\n        port: 0",
    );
    let f = write(&hub, "bad1.yaml", &bad_port);
    let o = hub.tetherctl(&["apply", "-f", &f]).unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("spec.proxyServer.entrypoints[1].port") && err.contains("nothing applied"),
        "{err}"
    );
    let bad_proxy = good().replace(
        "    noProxy: \"10.0.0.0/8,.svc\"",
        "    noProxy: \"10.0.0.0/8,.svc\"\n    httpsProxy: \"socks5://p:1080\"",
    );
    let f = write(&hub, "bad2.yaml", &bad_proxy);
    let o = hub.tetherctl(&["apply", "-f", &f]).unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(
            "document 2 (AddOnDeploymentConfig/cluster-proxy-config): spec.proxyConfig.httpsProxy"
        ),
        "{err}"
    );
    let f = write(
        &hub,
        "bad3.json",
        r#"{"apiVersion":"addon.open-cluster-management.io/v1alpha1","kind":"ClusterManagementAddOn","metadata":{"name":"cluster-proxy"},"spec":{"installStrategy":{"type":"Sometimes"}}}"#,
    );
    let o = hub.tetherctl(&["apply", "-f", &f]).unwrap();
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("spec.installStrategy.type"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stored_names(&hub).is_empty(), "{:?}", stored_names(&hub));

    // An accepted cluster, then the add-on resources.
    hub.tetherctl_ok(&["accept", "c1"]).unwrap();
    let f = write(&hub, "good.yaml", &good());
    let out = hub.tetherctl_ok(&["apply", "-f", &f]).unwrap();
    assert!(
        out.contains("clustermanagementaddon/cluster-proxy created"),
        "{out}"
    );
    // Re-applying is a no-op.
    let out = hub.tetherctl_ok(&["apply", "-f", &f]).unwrap();
    assert_eq!(out.matches("unchanged").count(), 3, "{out}");

    // noProxy alone is kept.
    let configs = json(&hub, &["get", "configs", "-o", "json"]);
    let adc = configs["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["kind"] == "AddOnDeploymentConfig")
        .unwrap();
    assert_eq!(
        adc["spec"]["proxyConfig"],
        serde_json::json!({"noProxy": "10.0.0.0/8,.svc"})
    );
    let table = hub.tetherctl_ok(&["get", "configs"]).unwrap();
    assert!(
        table.contains("entrypoints=broker-1.hub.example:8091,broker-2.hub.example:8091"),
        "{table}"
    );

    // The add-on appears with both config references hashed, Progressing until applied.
    let mca = wait_addon(&hub, "c1", "c1 add-on with hashes, Progressing", |m| {
        let refs = m["status"]["configReferences"].as_array().map(Vec::len);
        refs == Some(2)
            && m["status"]["configReferences"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["desiredConfig"]["specHash"].as_str().map(str::len) == Some(64))
            && cond(m, "Progressing").as_deref() == Some("True")
    });
    assert_eq!(mca["metadata"]["namespace"], "c1");
    assert_eq!(cond(&mca, "Degraded").as_deref(), Some("False"));
    assert_eq!(cond(&mca, "Available").as_deref(), Some("Unknown"));
    let h1 = adc_hash(&mca).unwrap();
    let table = hub.tetherctl_ok(&["get", "addons"]).unwrap();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("c1") && l.contains("cluster-proxy")),
        "{table}"
    );

    // The agent reports the hashes applied: Progressing=False.
    report_applied(&hub, "c1", &mca);
    wait_addon(&hub, "c1", "Progressing=False after the report", |m| {
        cond(m, "Progressing").as_deref() == Some("False")
    });

    // Change the AddOnDeploymentConfig: new hash, Progressing again.
    let changed = good().replace(
        "    noProxy: \"10.0.0.0/8,.svc\"",
        "    noProxy: \"10.0.0.0/8,.svc\"\n    httpProxy: \"http://proxy.example:3128\"",
    );
    let f2 = write(&hub, "changed.yaml", &changed);
    let out = hub.tetherctl_ok(&["apply", "-f", &f2]).unwrap();
    assert!(
        out.contains("addondeploymentconfig/default/cluster-proxy-config configured"),
        "{out}"
    );
    let mca2 = wait_addon(&hub, "c1", "new hash and Progressing=True", |m| {
        adc_hash(m).is_some_and(|h| h != h1) && cond(m, "Progressing").as_deref() == Some("True")
    });
    // The previously applied hash is still what the agent runs.
    let last = mca2["status"]["configReferences"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resource"] == "addondeploymentconfigs")
        .unwrap()["lastAppliedConfig"]["specHash"]
        .clone();
    assert_eq!(last, serde_json::json!(h1));

    // A missing config makes it Degraded, naming the config.
    hub.tetherctl_ok(&["delete", "adc", "cluster-proxy-config"])
        .unwrap();
    let m = wait_addon(&hub, "c1", "Degraded=True", |m| {
        cond(m, "Degraded").as_deref() == Some("True")
    });
    let msg = m["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Degraded")
        .unwrap()["message"]
        .to_string();
    assert!(msg.contains("cluster-proxy-config"), "{msg}");
    hub.tetherctl_ok(&["apply", "-f", &f2]).unwrap();

    // A second cluster; the strategy narrows to a label neither has: both add-ons go.
    hub.tetherctl_ok(&["accept", "c2"]).unwrap();
    wait_addon(&hub, "c2", "c2 add-on", |_| true);
    let narrowed = good().replace(
        "    type: All",
        "    type: LabelSelector\n    selector:\n      matchLabels:\n        env: prod",
    );
    let f3 = write(&hub, "narrowed.yaml", &narrowed);
    hub.tetherctl_ok(&["apply", "-f", &f3]).unwrap();
    wait_until(WAIT, "add-ons removed when no cluster matches", || {
        (addon(&hub, "c1").is_none() && addon(&hub, "c2").is_none()).then_some(())
    })
    .unwrap();
    hub.tetherctl_ok(&["apply", "-f", &f2]).unwrap();
    wait_addon(&hub, "c1", "c1 add-on back", |_| true);
    wait_addon(&hub, "c2", "c2 add-on back", |_| true);

    // Deleting the cluster removes its add-on, not the other's.
    let out = hub.tetherctl_ok(&["delete", "cluster", "c1"]).unwrap();
    assert!(out.contains("managedcluster/c1 deleted"), "{out}");
    wait_until(WAIT, "c1 add-on removed", || {
        addon(&hub, "c1").is_none().then_some(())
    })
    .unwrap();
    assert!(addon(&hub, "c2").is_some());
    let events = hub
        .tetherctl_ok(&["get", "events", "c1.cluster-proxy"])
        .unwrap();
    assert!(
        events.contains("AddOnInstalled") && events.contains("AddOnRemoved"),
        "{events}"
    );
    let o = hub.tetherctl(&["delete", "cluster", "c1"]).unwrap();
    assert!(!o.status.success());
}

#[test]
fn addon_state_survives_nats_restart() {
    let mut hub = Hub::start(HubOpts::default()).unwrap();
    hub.tetherctl_ok(&["accept", "c1"]).unwrap();
    let f = write(&hub, "good.yaml", &good());
    hub.tetherctl_ok(&["apply", "-f", &f]).unwrap();
    let before = wait_addon(&hub, "c1", "c1 add-on", |m| {
        adc_hash(m).is_some_and(|h| h.len() == 64)
    });

    hub.stop_nats().unwrap();
    hub.start_nats().unwrap();

    let after = wait_addon(&hub, "c1", "c1 add-on after restart", |_| true);
    assert_eq!(after["metadata"]["uid"], before["metadata"]["uid"]);
    assert_eq!(adc_hash(&after), adc_hash(&before));
    let mut names = stored_names(&hub);
    names.sort();
    assert_eq!(
        names,
        ["cluster-proxy", "cluster-proxy", "cluster-proxy-config"]
    );

    // The controller still works after the restart: a second cluster gets its add-on. (The
    // addon-manager reconnects with backoff; accept answers once it is back.)
    wait_until(WAIT, "accept c2 after the restart", || {
        hub.tetherctl_ok(&["accept", "c2"]).ok()
    })
    .unwrap();
    let m = wait_addon(&hub, "c2", "c2 add-on after restart", |m| {
        cond(m, "Progressing").as_deref() == Some("True")
    });
    assert_eq!(adc_hash(&m), adc_hash(&before));
}

#[test]
fn available_follows_addon_lease_and_unknown_cluster() {
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["*".into()],
        ..Default::default()
    })
    .unwrap();
    let boot = hub.dir.join("bootstrap.kubeconfig");
    hub.join(&boot, &hub.server_url(), &hub.token, None, None)
        .unwrap();
    let creds = hub.dir.join("creds");
    let agent = start_agent(&hub.logs, "agent", "edge-1", &boot, &creds, None).unwrap();
    hub.wait_condition("edge-1", "ManagedClusterConditionAvailable", "True", WAIT)
        .unwrap();
    let f = write(&hub, "good.yaml", &good());
    hub.tetherctl_ok(&["apply", "-f", &f]).unwrap();
    let m = wait_addon(&hub, "edge-1", "add-on waiting for its lease", |m| {
        cond(m, "Available").as_deref() == Some("Unknown")
    });
    assert_eq!(reason(&m, "Available"), "WaitingForLease");

    // A lease for an add-on that is not installed is refused.
    let r = admin_request(
        &hub,
        subjects::cluster_addon_lease("edge-2", "cluster-proxy"),
        serde_json::json!({"holderIdentity": "agent", "leaseDurationSeconds": 1}),
    )
    .unwrap();
    assert_eq!(r["accepted"], false, "{r}");

    // The add-on agent renews: Available=True; it stops: False after 5 × 1 s.
    let r = admin_request(
        &hub,
        subjects::cluster_addon_lease("edge-1", "cluster-proxy"),
        serde_json::json!({"holderIdentity": "agent", "leaseDurationSeconds": 1}),
    )
    .unwrap();
    assert_eq!(r["accepted"], true, "{r}");
    wait_addon(&hub, "edge-1", "Available=True", |m| {
        cond(m, "Available").as_deref() == Some("True")
    });
    let m = wait_addon(&hub, "edge-1", "Available=False", |m| {
        cond(m, "Available").as_deref() == Some("False")
    });
    assert_eq!(
        reason(&m, "Available"),
        "ManagedClusterAddOnLeaseUpdateStopped"
    );

    // The cluster goes Unknown (its agent stops): the add-on goes Unknown with it.
    agent.child.terminate();
    hub.wait_condition(
        "edge-1",
        "ManagedClusterConditionAvailable",
        "Unknown",
        WAIT,
    )
    .unwrap();
    let m = wait_addon(&hub, "edge-1", "Available=Unknown with the cluster", |m| {
        cond(m, "Available").as_deref() == Some("Unknown")
    });
    assert_eq!(reason(&m, "Available"), "ClusterUnknown");
}
