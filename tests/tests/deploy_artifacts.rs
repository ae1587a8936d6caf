//! The deployment artifacts (`compose/`, `helm/`, `observability/`) stay in step with the code:
//!
//! - every service config under `compose/config/` loads with the service's own config type and
//!   validation (`tether_config::load`), so a renamed or removed field breaks this test; the
//!   add-on resources validate with the parser `tetherctl apply` uses; the Helm charts' embedded
//!   broker and prober configs, rendered with the chart defaults, load the same way;
//! - every YAML file under `compose/`, `helm/*/` (values, Chart) and `observability/` parses,
//!   and the Grafana dashboard is JSON with a query per panel;
//! - the compose topology: the services, the cluster's internal edge network, the agent only
//!   behind the proxy; every `--flag` given to a Tether binary exists in its `--help`;
//! - every `tether_*` name in `observability/` is a metric of `docs/metrics.md` (histograms with
//!   `_bucket`/`_sum`/`_count`), and label matchers on them use the catalogued labels;
//! - label values in matchers are among those `docs/metrics.md` lists for the label.
//!
//! `promtool` checks and the alert unit tests: `tests/tests/observability_rules.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

mod helm_support;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Directories `compose/README.md` has the user create (secrets, git-ignored): not checked.
const LOCAL_DIRS: [&str; 3] = ["hub-dir", "certs", "cluster-dir"];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if !LOCAL_DIRS.contains(&name.as_str()) {
                files(&p, out);
            }
        } else {
            out.push(p);
        }
    }
}

fn all_files(dir: &str) -> Vec<PathBuf> {
    let mut v = Vec::new();
    files(&root().join(dir), &mut v);
    v
}

fn is_yaml(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "yaml" || e == "yml")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every YAML document of a file, as JSON values.
fn yaml_docs(p: &Path) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(&read(p))
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", p.display()))
}

fn yaml(p: &Path) -> Value {
    let mut docs = yaml_docs(p);
    assert_eq!(docs.len(), 1, "{}: expected one YAML document", p.display());
    docs.remove(0)
}

fn load_broker(p: &Path) -> tunnel_broker::config::BrokerConfig {
    tether_config::load(p).unwrap_or_else(|e| panic!("{e}"))
}

fn load_prober(p: &Path) -> health_prober::config::ProberConfig {
    tether_config::load(p).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn compose_service_configs_load_with_the_real_config_types() {
    let dir = root().join("compose/config");
    let mut brokers = BTreeMap::new();
    let mut checked = 0;
    for p in all_files("compose/config")
        .into_iter()
        .filter(|p| is_yaml(p))
    {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("broker-") {
            let cfg = load_broker(&p);
            assert_eq!(
                name,
                format!("broker-{}.yaml", cfg.id),
                "file name names the broker id"
            );
            let cp = cfg
                .control_plane
                .as_ref()
                .unwrap_or_else(|| panic!("{name}: brokers announce themselves: control_plane"));
            assert_eq!(cp.nats_url, "tls://nats:4222", "{name}");
            // Brokers see the certs volume only, never the hub directory (CA key).
            assert_eq!(
                cp.password_file,
                Path::new("/etc/tether/certs/hub-user.password")
            );
            assert_eq!(cfg.tls.ca, Path::new("/etc/tether/certs/ca.crt"), "{name}");
            assert!(cp.discover_peers, "{name}: brokers relay for each other");
            assert_eq!(
                cp.advertise.agent_addresses,
                vec![format!("broker-{}:8091", cfg.id)],
                "{name}: agents dial the compose service name"
            );
            assert_eq!(cfg.agent_listen.port(), 8091);
            brokers.insert(cfg.id.clone(), cfg);
        } else if name == "health-prober.yaml" {
            let cfg = load_prober(&p);
            let nats = cfg.nats.as_ref().expect("the prober runs on NATS");
            assert_eq!(nats.hub_dir, None, "the prober sees no hub directory");
            assert_eq!(nats.url.as_deref(), Some("tls://nats:4222"));
            assert_eq!(
                nats.password_file.as_deref(),
                Some(Path::new("/etc/tether/certs/hub-user.password"))
            );
            assert!(
                cfg.apiserver_ca.is_some(),
                "probes verify the API servers' TLS"
            );
            assert_eq!(cfg.broker.endpoint, "https://broker-b1:8443");
            assert!(cfg.broker.cert.is_some() && cfg.broker.key.is_some());
        } else if name == "addons.yaml" {
            // Applied by compose/scripts/setup.sh with `tetherctl apply`: its parser.
            let text = std::fs::read_to_string(&p).unwrap();
            let docs = tether_control::resources::parse_documents(&text)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let kinds: Vec<String> = docs
                .into_iter()
                .map(|d| {
                    let kind = d["kind"].as_str().unwrap_or_default().to_string();
                    tether_control::addons::parse_resource(d)
                        .unwrap_or_else(|e| panic!("{name}: {kind}: {e}"));
                    kind
                })
                .collect();
            assert_eq!(
                kinds,
                [
                    "ClusterManagementAddOn",
                    "ManagedProxyConfiguration",
                    "AddOnDeploymentConfig"
                ],
                "{name}"
            );
        } else {
            panic!(
                "{}: a config file this test does not know; load it with its service's config type here",
                p.display()
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 4, "files checked in {}", dir.display());
    assert_eq!(
        brokers.keys().map(String::as_str).collect::<Vec<_>>(),
        ["b1", "b2"]
    );
    // The prober authenticates as a static client of the brokers it may land on.
    for b in brokers.values() {
        assert!(
            b.clients.iter().any(|c| c.name == "health-prober"),
            "broker {} lists the health-prober client",
            b.id
        );
    }
}

#[test]
fn helm_embedded_configs_load_with_the_real_config_types() {
    if !helm_support::have("helm", &["version"]) {
        return;
    }
    let charts = helm_support::Charts::build();
    let d = helm_support::docs(
        &charts
            .template("tether-hub", "hub", "tether", None, &[])
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let data = helm_support::config_data(&d, "hub-broker");
    let broker_yaml = data["broker.yaml.tmpl"]
        .as_str()
        .expect("broker.yaml.tmpl")
        .replace("__BROKER_ID__", "hub-broker-0");
    let cfg: tunnel_broker::config::BrokerConfig =
        tether_config::from_str(&broker_yaml, Path::new("helm broker.yaml"))
            .unwrap_or_else(|e| panic!("{e}\n{broker_yaml}"));
    assert_eq!(cfg.id, "hub-broker-0");
    let cp = cfg.control_plane.expect("control_plane");
    assert_eq!(
        cp.advertise.agent_addresses,
        ["hub-broker-0.hub.example.com:8091"]
    );
    assert_eq!(cp.nats_url, "tls://hub-nats.tether.svc:4222");
    assert_eq!(cfg.clients[0].name, "health-prober");

    let data = helm_support::config_data(&d, "hub-health-prober");
    let prober_yaml = data["prober.yaml"].as_str().expect("prober.yaml");
    let cfg: health_prober::config::ProberConfig =
        tether_config::from_str(prober_yaml, Path::new("helm prober.yaml"))
            .unwrap_or_else(|e| panic!("{e}\n{prober_yaml}"));
    assert!(cfg.nats.is_some() && cfg.apiserver_ca.is_none());
}

#[test]
fn every_yaml_and_json_artifact_parses() {
    let mut n = 0;
    for dir in ["compose", "observability"] {
        for p in all_files(dir).into_iter().filter(|p| is_yaml(p)) {
            assert!(!yaml_docs(&p).is_empty(), "{}: empty", p.display());
            n += 1;
        }
    }
    for chart in helm_support::CHARTS {
        for f in ["values.yaml", "Chart.yaml"] {
            let v = yaml(&root().join("helm").join(chart).join(f));
            assert!(v.is_object(), "helm/{chart}/{f}");
            n += 1;
        }
        let c = yaml(&root().join("helm").join(chart).join("Chart.yaml"));
        assert_eq!(c["apiVersion"], "v2");
        assert_eq!(c["name"], chart);
    }
    assert!(n >= 13, "only {n} YAML files found");

    let dash: Value =
        serde_json::from_str(&read(&root().join("observability/grafana/tether.json"))).unwrap();
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10);
    for p in panels {
        let targets = p["targets"].as_array().expect("targets");
        assert!(
            !targets.is_empty() && targets.iter().all(|t| t["expr"].is_string()),
            "panel {} has a query",
            p["title"]
        );
    }

    let rules = yaml(&root().join("observability/prometheus/alerts.yml"));
    let mut alerts = 0;
    for g in rules["groups"].as_array().expect("groups") {
        assert!(g["name"].is_string());
        for r in g["rules"].as_array().expect("rules") {
            assert!(r["alert"].is_string() && r["expr"].is_string(), "{r}");
            alerts += 1;
        }
    }
    assert!(alerts >= 10);
    let prom = yaml(&root().join("observability/prometheus/prometheus.yml"));
    let jobs: Vec<&str> = prom["scrape_configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["job_name"].as_str().unwrap())
        .collect();
    for j in [
        "tether-broker",
        "tether-addon-manager",
        "tether-health-prober",
        "tether-registration-agent",
    ] {
        assert!(jobs.contains(&j), "scrape job {j}");
    }
    let otel = yaml(&root().join("observability/otel-collector.yaml"));
    assert!(otel["receivers"]["otlp"]["protocols"]["grpc"].is_object());
    assert!(otel["service"]["pipelines"]["traces"]["exporters"].is_array());
}

fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a.iter().flat_map(strings).collect(),
        _ => vec![],
    }
}

#[test]
fn compose_topology_puts_the_agents_behind_their_proxies() {
    let compose = yaml(&root().join("compose/compose.yaml"));
    let services = compose["services"].as_object().unwrap();
    for s in [
        "init",
        "setup",
        "nats",
        "addon-manager",
        "broker-b1",
        "broker-b2",
        "health-prober",
        "prometheus",
        "grafana",
    ] {
        assert!(services.contains_key(s), "compose.yaml service {s}");
    }
    assert_eq!(
        strings(&services["nats"]["command"]),
        ["nats-server", "-c", "/etc/tether/hub/nats/nats.conf"]
    );
    for b in ["b1", "b2"] {
        let cmd = strings(&services[&format!("broker-{b}")]["command"]);
        assert_eq!(
            cmd,
            [
                "tunnel-broker",
                "--config",
                &format!("/etc/tether/config/broker-{b}.yaml")
            ]
        );
    }
    let nets = &compose["networks"];
    for c in ["edge-1", "edge-2"] {
        assert_eq!(nets[c]["internal"], true, "{c} is internal");
        let agent = &services[&format!("agent-{c}")];
        assert_eq!(strings(&agent["networks"]), [c], "agent-{c} only on {c}");
        let mut squid_nets: Vec<&String> = services[&format!("squid-{c}")]["networks"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        squid_nets.sort();
        assert_eq!(
            squid_nets,
            [&c.to_string(), &"hub".to_string()],
            "squid-{c}"
        );
        let cmd = strings(&agent["command"]);
        assert!(cmd.iter().any(|a| a == "--addon=cluster-proxy"), "{cmd:?}");
        assert!(
            cmd.contains(&format!("--cluster-name={c}")),
            "agent-{c}: {cmd:?}"
        );
    }
    // Every long-running service has a healthcheck and runs as a non-root user.
    for (name, s) in services {
        if s["restart"] == "no" || s["profiles"].is_array() {
            continue;
        }
        assert!(s["healthcheck"]["test"].is_array(), "{name}: healthcheck");
        let user = s["user"].as_str().unwrap_or("");
        assert!(
            !user.starts_with('0') && user != "root",
            "{name}: user {user:?}"
        );
    }
}

/// `--flag` names of a command line (`--flag=value` or `--flag value`).
fn flags(args: &[String]) -> Vec<String> {
    args.iter()
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap().to_string())
        .collect()
}

/// The `--flag` names a binary's `--help` lists.
fn help_flags(bin: &str) -> BTreeSet<String> {
    let path = tether_test_support::bin(bin).expect("binaries are built (target/debug)");
    let out = std::process::Command::new(&path)
        .arg("--help")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| {
            w.trim_end_matches([',', '.'])
                .split(['=', '<'])
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn every_flag_in_compose_and_helm_exists() {
    let mut uses: Vec<(String, Vec<String>, String)> = Vec::new();
    const TETHER_BINS: [&str; 6] = [
        "tunnel-broker",
        "tunnel-agent",
        "registration-agent",
        "addon-manager",
        "health-prober",
        "tetherctl",
    ];
    for f in ["compose/compose.yaml"] {
        let v = yaml(&root().join(f));
        for (name, s) in v["services"].as_object().unwrap() {
            let cmd = strings(&s["command"]);
            if let Some(bin) = cmd.first().filter(|b| TETHER_BINS.contains(&b.as_str())) {
                uses.push((bin.clone(), cmd[1..].to_vec(), format!("{f} {name}")));
            }
        }
    }
    // Helm: the list-form commands of every rendered container (the umbrella with the agent,
    // with both secret stores / runtimes).
    if helm_support::have("helm", &["version"]) {
        let charts = helm_support::Charts::build();
        for sets in [
            &["tether-agent.enabled=true"][..],
            &[
                "tether-agent.enabled=true",
                "tether-agent.secretStore=file",
                "tether-agent.addonRuntime=local",
            ][..],
        ] {
            let d = helm_support::docs(
                &charts
                    .template("tether", "t", "tether", None, sets)
                    .unwrap(),
            );
            for (name, spec, _) in helm_support::pods(&d) {
                for c in spec["containers"].as_array().into_iter().flatten() {
                    let cmd = strings(&c["command"]);
                    if let Some(bin) = cmd.first().filter(|b| TETHER_BINS.contains(&b.as_str())) {
                        uses.push((bin.clone(), cmd[1..].to_vec(), format!("helm {name}")));
                    }
                }
            }
        }
    }
    let mut seen = BTreeSet::new();
    for (bin, args, origin) in &uses {
        let known = help_flags(bin);
        for flag in flags(args) {
            assert!(
                known.contains(&flag),
                "{origin}: {bin} has no flag {flag} (known: {known:?})"
            );
        }
        seen.insert(bin.clone());
    }
    for b in [
        "addon-manager",
        "tunnel-broker",
        "health-prober",
        "registration-agent",
    ] {
        assert!(seen.contains(b), "no command line of {b} checked");
    }
}

/// Metric name → (is a histogram, label names), from the tables of `docs/metrics.md`.
fn catalogue() -> BTreeMap<String, (bool, BTreeSet<String>)> {
    let mut out = BTreeMap::new();
    let mut has_labels = false;
    for line in read(&root().join("docs/metrics.md")).lines() {
        if line.starts_with("| metric |") {
            has_labels = line.contains("| labels |");
            continue;
        }
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        if cols.len() < 4 || !cols[1].starts_with("`tether_") {
            continue;
        }
        let name = cols[1].trim_matches('`').to_string();
        let histogram = cols[2] == "histogram";
        let mut labels = BTreeSet::new();
        if has_labels {
            // Label names are the backticked words outside parentheses (those list values).
            let mut depth = 0;
            let mut outside = String::new();
            for c in cols[3].chars() {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ if depth == 0 => outside.push(c),
                    _ => {}
                }
            }
            for l in outside.split('`').skip(1).step_by(2) {
                labels.insert(l.to_string());
            }
        }
        out.insert(name, (histogram, labels));
    }
    out
}

/// `tether_*` identifiers in `text`, each with its `{...}` label matcher names when present.
fn metric_uses(text: &str) -> Vec<(String, Vec<String>)> {
    let is_ident = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    let mut out = Vec::new();
    let bytes: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let starts = text_at(&bytes, i, "tether_")
            && (i == 0 || !(is_ident(bytes[i - 1]) || bytes[i - 1].is_ascii_alphabetic()));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < bytes.len() && is_ident(bytes[j]) {
            j += 1;
        }
        let name: String = bytes[i..j].iter().collect();
        let mut labels = Vec::new();
        if j < bytes.len() && bytes[j] == '{' {
            let end = bytes[j..].iter().position(|c| *c == '}').unwrap() + j;
            let inner: String = bytes[j + 1..end].iter().collect();
            for m in inner.split(',') {
                let k: String = m.trim().chars().take_while(|c| is_ident(*c)).collect();
                if !k.is_empty() {
                    labels.push(k);
                }
            }
            j = end;
        }
        // `tether_*` in prose, and the name prefix alone, are not metric names.
        if name.len() > "tether_".len() && !name.ends_with('_') {
            out.push((name, labels));
        }
        i = j;
    }
    out
}

fn text_at(chars: &[char], i: usize, s: &str) -> bool {
    s.chars()
        .enumerate()
        .all(|(k, c)| chars.get(i + k) == Some(&c))
}

/// (metric, label) → the values `docs/metrics.md` lists for it: a backticked label name
/// followed by a parenthesis of backticked values, e.g. `result` (`ok`, `error`).
fn catalogued_label_values() -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for line in read(&root().join("docs/metrics.md")).lines() {
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        if cols.len() < 5 || !cols[1].starts_with("`tether_") {
            continue;
        }
        let metric = cols[1].trim_matches('`').to_string();
        let mut rest = cols[3];
        while let Some(open) = rest.find(" (`") {
            let label = rest[..open].rsplit('`').nth(1).unwrap_or("").to_string();
            let close = rest[open..].find(')').map_or(rest.len(), |c| c + open);
            let values = rest[open + 2..close]
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect();
            out.insert((metric.clone(), label), values);
            rest = &rest[close..];
        }
    }
    out
}

/// `label` `op` `"value"` matchers of every `tether_*{...}` selector in `text`.
fn label_matchers(text: &str) -> Vec<(String, String, String, String)> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("tether_") {
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        let after = &text[i + name.len()..];
        let Some(inner) = after
            .strip_prefix('{')
            .and_then(|a| a.split_once('}'))
            .map(|(m, _)| m)
        else {
            continue;
        };
        for m in inner.split(',') {
            for op in ["!~", "=~", "!=", "="] {
                if let Some((l, v)) = m.split_once(op) {
                    out.push((
                        name.clone(),
                        l.trim().to_string(),
                        op.to_string(),
                        // JSON files escape the quotes.
                        v.trim().trim_matches(['"', '\\']).to_string(),
                    ));
                    break;
                }
            }
        }
    }
    out
}

#[test]
fn observability_label_values_are_the_emitted_ones() {
    let values = catalogued_label_values();
    assert_eq!(
        values[&(
            "tether_hub_auth_callout_total".to_string(),
            "result".to_string()
        )],
        ["allowed", "refused"].map(String::from).into()
    );
    let mut checked = 0;
    for p in all_files("observability") {
        for (metric, label, op, value) in label_matchers(&read(&p)) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| metric.strip_suffix(s))
                .filter(|b| values.keys().any(|(m, _)| m == b))
                .unwrap_or(&metric);
            let Some(known) = values.get(&(base.to_string(), label.clone())) else {
                continue;
            };
            // A regex is checked alternative by alternative (plain words only).
            let alternatives: Vec<&str> = if op.contains('~') {
                value.split('|').collect()
            } else {
                vec![value.as_str()]
            };
            for v in alternatives {
                assert!(
                    known.contains(v),
                    "{}: {base}{{{label}{op}\"{value}\"}}: {v:?} is not a value the code emits (docs/metrics.md: {known:?})",
                    p.display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 5, "only {checked} label values checked");
}

#[test]
fn observability_uses_only_catalogued_metrics_and_labels() {
    let cat = catalogue();
    assert!(
        cat.len() > 40,
        "catalogue parse found {} metrics",
        cat.len()
    );
    assert!(cat["tether_broker_dial_duration_seconds"].0);
    assert!(
        cat["tether_broker_dial_failures_total"]
            .1
            .contains("reason")
    );
    // Labels Prometheus adds to every series (scrape target, relabelling in prometheus.yml).
    let target_labels = ["job", "instance", "component", "namespace", "pod"];
    let mut used = BTreeSet::new();
    for p in all_files("observability") {
        for (name, labels) in metric_uses(&read(&p)) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|b| cat.get(*b).is_some_and(|(h, _)| *h))
                })
                .unwrap_or(&name);
            let (_, known) = cat.get(base).unwrap_or_else(|| {
                panic!(
                    "{}: {name} is not in docs/metrics.md",
                    p.strip_prefix(root()).unwrap_or(&p).display()
                )
            });
            for l in labels {
                assert!(
                    known.contains(&l) || target_labels.contains(&l.as_str()),
                    "{}: {base} has no label {l} (catalogue: {known:?})",
                    p.display()
                );
            }
            used.insert(base.to_string());
        }
    }
    for m in [
        "tether_broker_tunnels",
        "tether_broker_open_streams",
        "tether_broker_bytes_total",
        "tether_broker_dial_duration_seconds",
        "tether_broker_dial_failures_total",
        "tether_prober_probe_duration_seconds",
        "tether_prober_cluster_healthy",
        "tether_hub_csrs_signed_total",
        "tether_hub_registration_duration_seconds",
        "tether_broker_control_plane_connected",
        "tether_tls_certificate_expiry_timestamp_seconds",
        "tether_tls_reload_failures_total",
        "tether_prober_rounds_overrun_total",
        "tether_agent_addon_lease_renewals_total",
        "tether_agent_addon_connected_brokers",
    ] {
        assert!(used.contains(m), "observability/ does not use {m}");
    }
}
