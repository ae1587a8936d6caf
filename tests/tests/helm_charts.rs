//! The Helm charts with the real `helm` and `kubernetes-validate` (scripts/install-deps.sh
//! installs both; when one is absent each test prints `SKIPPED: ...` and passes):
//! - `helm lint --strict` on every chart (and the umbrella with the realistic values);
//! - `helm template` of the umbrella chart with its defaults and with
//!   `helm/tether/ci/realistic-values.yaml`, validated by `kubernetes-validate --strict` for
//!   Kubernetes 1.29 and 1.33;
//! - bad values fail with the schema's message (`brokers.replicas=two`, invalid names);
//! - every rendered pod meets Pod Security "restricted" (checked field by field here), has
//!   resources, the `app.kubernetes.io/part-of: tether` label the shipped scrape job selects,
//!   and no service-account token unless it uses the API (bootstrap Job, registration-agent);
//! - RBAC: every get/patch/delete rule is limited by `resourceNames`; nobody lists or watches;
//! - the committed `helm/tether/charts/*.tgz` are what `helm dependency build` makes of the
//!   current subchart sources (so `helm template helm/tether` works from a clean clone).
//!
//! Run: `cargo test -p tether-e2e --test helm_charts` (~10 s).

mod helm_support;

use std::collections::BTreeSet;
use std::process::Command;

use helm_support::*;
use serde_json::Value;

fn tools() -> bool {
    have("helm", &["version"]) && have("kubernetes-validate", &["--version"])
}

const REALISTIC: &str = "helm/tether/ci/realistic-values.yaml";

#[test]
fn every_chart_lints_strictly() {
    if !have("helm", &["version"]) {
        return;
    }
    let charts = Charts::build();
    for c in CHARTS {
        let out = run(Command::new("helm")
            .args(["lint", "--strict"])
            .arg(charts.chart(c)))
        .unwrap_or_else(|e| panic!("helm lint --strict {c}: {e}"));
        assert!(out.contains("0 chart(s) failed"), "{c}: {out}");
    }
    let out = run(Command::new("helm")
        .args(["lint", "--strict"])
        .arg(charts.chart("tether"))
        .arg("-f")
        .arg(root().join(REALISTIC)))
    .expect("lint with realistic values");
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn umbrella_renders_valid_manifests_for_kubernetes_1_29_and_1_33() {
    if !tools() {
        return;
    }
    let charts = Charts::build();
    let tmp = tempfile::tempdir().unwrap();
    let realistic = root().join(REALISTIC);
    for (label, values) in [("defaults", None), ("realistic", Some(realistic.as_path()))] {
        let yaml = charts
            .template("tether", "t", "tether", values, &[])
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let kinds: BTreeSet<String> = docs(&yaml)
            .iter()
            .map(|d| d["kind"].as_str().unwrap_or_default().to_string())
            .collect();
        for k in [
            "StatefulSet",
            "Deployment",
            "Job",
            "PodDisruptionBudget",
            "Service",
            "ConfigMap",
            "Role",
        ] {
            assert!(kinds.contains(k), "{label}: no {k} rendered ({kinds:?})");
        }
        let f = tmp.path().join(format!("{label}.yaml"));
        std::fs::write(&f, &yaml).unwrap();
        for k in ["1.29.0", "1.33.0"] {
            let out = run(Command::new("kubernetes-validate")
                .args(["--strict", "-k", k])
                .arg(&f))
            .unwrap_or_else(|e| panic!("{label} for Kubernetes {k}: {e}"));
            assert!(
                !out.contains("ERROR") && !out.contains("WARN"),
                "{label} for Kubernetes {k}: {out}"
            );
        }
    }
}

#[test]
fn bad_values_fail_with_the_schema_message() {
    if !have("helm", &["version"]) {
        return;
    }
    let charts = Charts::build();
    for (set, want) in [
        (
            "tether-hub.brokers.replicas=two",
            "brokers.replicas: Invalid type. Expected: integer, given: string",
        ),
        (
            "tether-nats.cluster.name=Bad_Name",
            "cluster.name: Does not match pattern",
        ),
        (
            "tether-nats.cluster.replicas=0",
            "cluster.replicas: Must be greater than or equal to 1",
        ),
        (
            "tether-hub.brokers.advertiseDomain=not a domain",
            "brokers.advertiseDomain: Does not match pattern",
        ),
        (
            "tether-hub.brokers.agentPort=70000",
            "brokers.agentPort: Must be less than or equal to 65535",
        ),
        (
            "tether-hub.brokers.drainGrace=soon",
            "brokers.drainGrace: Does not match pattern",
        ),
        (
            "tether-hub.brokers.replica=2",
            "Additional property replica is not allowed",
        ),
    ] {
        let e = charts
            .template("tether", "t", "tether", None, &[set])
            .expect_err(set);
        assert!(e.contains(want), "--set {set}: expected {want:?} in\n{e}");
    }
    // The agent's cluster name, in the umbrella (agent enabled) and its own chart.
    let e = charts
        .template(
            "tether",
            "t",
            "tether",
            None,
            &[
                "tether-agent.enabled=true",
                "tether-agent.clusterName=Edge_1",
            ],
        )
        .unwrap_err();
    assert!(e.contains("clusterName: Does not match pattern"), "{e}");
    let e = charts
        .template("tether-agent", "a", "agent", None, &["clusterName=edge.1"])
        .unwrap_err();
    assert!(e.contains("clusterName: Does not match pattern"), "{e}");
    // The defaults themselves pass.
    charts
        .template(
            "tether",
            "t",
            "tether",
            None,
            &["tether-agent.enabled=true"],
        )
        .expect("defaults with the agent");
}

/// Pod Security Standards "restricted" (v1.29+), field by field, plus this project's own rules.
fn restricted_violations(name: &str, spec: &Value, labels: &Value) -> Vec<String> {
    let mut v = Vec::new();
    let mut bad = |m: String| v.push(format!("{name}: {m}"));
    for k in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[k] == true {
            bad(k.to_string());
        }
    }
    let pod_sc = &spec["securityContext"];
    let allowed_volumes = [
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    for vol in spec["volumes"].as_array().into_iter().flatten() {
        let kinds: Vec<&String> = vol
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "name")
            .collect();
        if kinds.iter().any(|k| !allowed_volumes.contains(&k.as_str())) {
            bad(format!("volume type {kinds:?}"));
        }
    }
    let containers: Vec<&Value> = ["containers", "initContainers", "ephemeralContainers"]
        .iter()
        .flat_map(|k| spec[*k].as_array().into_iter().flatten())
        .collect();
    if containers.is_empty() {
        bad("no containers".into());
    }
    for c in containers {
        let cn = c["name"].as_str().unwrap_or("?");
        let sc = &c["securityContext"];
        if sc["privileged"] == true {
            bad(format!("{cn}: privileged"));
        }
        if sc["allowPrivilegeEscalation"] != false {
            bad(format!("{cn}: allowPrivilegeEscalation is not false"));
        }
        let drops = sc["capabilities"]["drop"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !drops.iter().any(|d| d == "ALL") {
            bad(format!("{cn}: capabilities.drop lacks ALL"));
        }
        for a in sc["capabilities"]["add"].as_array().into_iter().flatten() {
            if a != "NET_BIND_SERVICE" {
                bad(format!("{cn}: adds capability {a}"));
            }
        }
        if !(sc["runAsNonRoot"] == true || pod_sc["runAsNonRoot"] == true) {
            bad(format!("{cn}: runAsNonRoot not true"));
        }
        if sc["runAsUser"] == 0 || pod_sc["runAsUser"] == 0 {
            bad(format!("{cn}: runAsUser 0"));
        }
        let seccomp = sc["seccompProfile"]["type"]
            .as_str()
            .or(pod_sc["seccompProfile"]["type"].as_str());
        if !matches!(seccomp, Some("RuntimeDefault" | "Localhost")) {
            bad(format!("{cn}: seccompProfile {seccomp:?}"));
        }
        for p in c["ports"].as_array().into_iter().flatten() {
            if p.get("hostPort").is_some_and(|h| h != 0) {
                bad(format!("{cn}: hostPort"));
            }
        }
        // Ours: read-only root, a full command (the images have no ENTRYPOINT), resources.
        if sc["readOnlyRootFilesystem"] != true {
            bad(format!("{cn}: root file system not read-only"));
        }
        if c["command"].as_array().is_none_or(|a| a.is_empty()) {
            bad(format!("{cn}: no command"));
        }
        let r = &c["resources"];
        if r["requests"]["cpu"].is_null()
            || r["requests"]["memory"].is_null()
            || r["limits"]["memory"].is_null()
        {
            bad(format!(
                "{cn}: resources without cpu/memory requests and a memory limit"
            ));
        }
    }
    if labels["app.kubernetes.io/part-of"] != "tether" {
        bad("pod template lacks app.kubernetes.io/part-of: tether (the scrape job keeps only those)".into());
    }
    let uses_api = matches!(
        labels["app.kubernetes.io/component"].as_str(),
        Some("bootstrap" | "registration-agent")
    );
    if !uses_api && spec["automountServiceAccountToken"] != false {
        bad("mounts a service-account token it never uses".into());
    }
    v
}

#[test]
fn every_rendered_pod_meets_pod_security_restricted() {
    if !have("helm", &["version"]) {
        return;
    }
    let charts = Charts::build();
    let realistic = root().join(REALISTIC);
    let mut checked = BTreeSet::new();
    for values in [None, Some(realistic.as_path())] {
        let d = docs(
            &charts
                .template(
                    "tether",
                    "t",
                    "tether",
                    values,
                    &["tether-agent.enabled=true"],
                )
                .unwrap(),
        );
        let pods = pods(&d);
        let mut violations = Vec::new();
        for (name, spec, labels) in &pods {
            violations.extend(restricted_violations(name, spec, labels));
            checked.insert(name.clone());
        }
        assert!(violations.is_empty(), "{violations:#?}");
        // Scraped pods carry the annotations the scrape job reads.
        for (name, _, labels) in &pods {
            let component = labels["app.kubernetes.io/component"].as_str().unwrap_or("");
            if matches!(
                component,
                "tunnel-broker" | "addon-manager" | "health-prober" | "registration-agent"
            ) {
                let w = d
                    .iter()
                    .find(|x| {
                        format!(
                            "{}/{}",
                            x["kind"].as_str().unwrap(),
                            x["metadata"]["name"].as_str().unwrap()
                        ) == *name
                    })
                    .unwrap();
                let a = &w["spec"]["template"]["metadata"]["annotations"];
                assert_eq!(a["prometheus.io/scrape"], "true", "{name}");
                assert!(
                    a["prometheus.io/port"]
                        .as_str()
                        .is_some_and(|p| p.parse::<u16>().is_ok()),
                    "{name}"
                );
            }
        }
    }
    for w in [
        "StatefulSet/t-nats",
        "StatefulSet/t-broker",
        "Deployment/t-addon-manager",
        "Deployment/t-health-prober",
        "Job/t-bootstrap",
        "Deployment/t-registration-agent",
    ] {
        assert!(checked.contains(w), "{w} not rendered ({checked:?})");
    }
    // The checker itself rejects what it should (a pod from before this chart's hardening).
    let old = serde_json::json!({
        "securityContext": {"runAsNonRoot": true, "runAsUser": 10001},
        "containers": [{"name": "c", "image": "i", "args": ["x"], "resources": {}}]
    });
    let v = restricted_violations("old", &old, &serde_json::json!({}));
    for want in [
        "allowPrivilegeEscalation",
        "drop lacks ALL",
        "seccompProfile",
        "read-only",
        "no command",
        "resources",
        "part-of",
        "token",
    ] {
        assert!(
            v.iter().any(|m| m.contains(want)),
            "{want} not reported: {v:#?}"
        );
    }
}

#[test]
fn brokers_get_pdb_spread_per_pod_services_and_certificates() {
    if !have("helm", &["version"]) {
        return;
    }
    let charts = Charts::build();
    let d = docs(
        &charts
            .template("tether", "t", "tether", Some(&root().join(REALISTIC)), &[])
            .unwrap(),
    );
    let pdb = find(&d, "PodDisruptionBudget", "t-broker");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "tunnel-broker"
    );
    let sts = find(&d, "StatefulSet", "t-broker");
    assert_eq!(sts["spec"]["replicas"], 3);
    let spread = sts["spec"]["template"]["spec"]["topologySpreadConstraints"]
        .as_array()
        .unwrap();
    assert!(
        spread
            .iter()
            .any(|s| s["topologyKey"] == "kubernetes.io/hostname")
    );
    let job = find(&d, "Job", "t-bootstrap");
    let script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
        .as_str()
        .unwrap();
    for i in 0..3 {
        let pod = format!("t-broker-{i}");
        find(&d, "Service", &format!("{pod}-agent"));
        assert!(
            script.contains(&format!("--identity broker:{pod} --name {pod}"))
                && script.contains(&format!("--san {pod}.tether.corp.example")),
            "no certificate for {pod} in\n{script}"
        );
    }
    for i in 0..3 {
        assert!(
            script.contains(&format!("--hub-host t-nats-{i}.t-nats-headless.tether.svc")),
            "{script}"
        );
    }
    // NATS: 3 routes over TLS, its config free of absolute paths of the Job.
    let conf = config_data(&d, "t-nats")["nats.conf"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(conf.matches("tls://t-nats-").count(), 3, "{conf}");
    assert!(
        conf.contains("include \"auth/auth.conf\"") && !conf.contains("/work/"),
        "{conf}"
    );
    // Monitoring objects, when asked for.
    let d = docs(
        &charts
            .template(
                "tether",
                "t",
                "tether",
                None,
                &[
                    "tether-hub.monitoring.serviceMonitor=true",
                    "tether-hub.monitoring.podMonitor=true",
                ],
            )
            .unwrap(),
    );
    for kind in ["ServiceMonitor", "PodMonitor"] {
        for c in ["tunnel-broker", "addon-manager", "health-prober"] {
            let m = find(&d, kind, &format!("t-{c}"));
            assert_eq!(
                m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
                c
            );
        }
    }
    // ServiceMonitors select Services that carry those labels.
    let svc = find(&d, "Service", "t-broker");
    assert_eq!(
        svc["metadata"]["labels"]["app.kubernetes.io/component"],
        "tunnel-broker"
    );
}

#[test]
fn rbac_is_least_privilege() {
    if !have("helm", &["version"]) {
        return;
    }
    let charts = Charts::build();
    let d = docs(
        &charts
            .template(
                "tether",
                "t",
                "tether",
                None,
                &["tether-agent.enabled=true"],
            )
            .unwrap(),
    );
    let roles: Vec<&Value> = d
        .iter()
        .filter(|x| x["kind"] == "Role" || x["kind"] == "ClusterRole")
        .collect();
    assert!(roles.len() >= 3, "{} roles", roles.len());
    for r in roles {
        let name = r["metadata"]["name"].as_str().unwrap();
        assert_eq!(r["kind"], "Role", "{name}: cluster-wide");
        for rule in r["rules"].as_array().unwrap() {
            let verbs: Vec<&str> = rule["verbs"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(Value::as_str)
                .collect();
            for v in &verbs {
                assert!(
                    !matches!(*v, "list" | "watch" | "update" | "*" | "deletecollection"),
                    "{name}: {v} in {rule}"
                );
            }
            // Everything but create (which RBAC cannot limit by name) names its objects.
            if verbs != ["create"] {
                assert!(
                    rule["resourceNames"]
                        .as_array()
                        .is_some_and(|n| !n.is_empty()),
                    "{name}: {verbs:?} without resourceNames"
                );
            }
        }
    }
    let addon = find(&d, "Role", "t-registration-agent-addon-runtime");
    let names: BTreeSet<String> = addon["rules"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["resourceNames"].as_array().cloned().unwrap_or_default())
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "cluster-proxy-agent".to_string(),
            "cluster-proxy-hub-kubeconfig".to_string()
        ])
    );
}

#[test]
fn committed_subchart_archives_match_the_sources() {
    if !have("helm", &["version"]) || !have("tar", &["--version"]) {
        return;
    }
    let charts = Charts::build();
    let unpack = |dir: &std::path::Path| -> Vec<(String, String)> {
        let out = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "tgz") {
                run(Command::new("tar")
                    .arg("-xzf")
                    .arg(&p)
                    .arg("-C")
                    .arg(out.path()))
                .unwrap();
            }
        }
        let mut stack = vec![out.path().to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    let rel = p.strip_prefix(out.path()).unwrap().display().to_string();
                    files.push((rel, std::fs::read_to_string(&p).unwrap_or_default()));
                }
            }
        }
        files.sort();
        files
    };
    let fresh = unpack(&charts.chart("tether").join("charts"));
    let committed = unpack(&root().join("helm/tether/charts"));
    assert!(fresh.len() > 10, "{} files", fresh.len());
    let names = |v: &[(String, String)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&committed),
        names(&fresh),
        "run `helm dependency build helm/tether` and commit helm/tether/charts"
    );
    for (a, b) in committed.iter().zip(&fresh) {
        assert!(
            a.1 == b.1,
            "helm/tether/charts: {} is stale: run `helm dependency build helm/tether`",
            a.0
        );
    }
}
