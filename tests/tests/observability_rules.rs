//! `observability/prometheus` checked by the promtool `scripts/install-deps.sh` installs
//! (Debian's `prometheus` package, `/usr/bin/promtool` 2.42), never whichever one is on PATH:
//! - `promtool check config prometheus.yml` (the compose scrape config, with its rule file);
//! - `promtool test rules alerts_test.yml`: unit tests of the alert rules (a successful login
//!   does not page, refusals do; a broker whose presence renewals fail fires; down targets and
//!   certificate expiry are found by `component` for compose and Kubernetes alike);
//! - every PromQL query of the Grafana dashboard parses (as recording rules, with the
//!   dashboard's interval variables filled in: `promtool check rules`).
//!
//! `kubernetes-pods.yml` is not given to this promtool: Debian builds it without Kubernetes
//! service discovery. Running the dashboard's queries against live data is
//! `tests/tests/compose_stack.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The promtool of `scripts/install-deps.sh` (apt package `prometheus`).
const PROMTOOL: &str = "/usr/bin/promtool";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../observability/prometheus")
}

fn promtool(args: &[&str], cwd: &Path) -> String {
    assert!(
        Path::new(PROMTOOL).is_file(),
        "{PROMTOOL} is missing: run scripts/install-deps.sh (apt package prometheus)"
    );
    let o = Command::new(PROMTOOL)
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap_or_else(|e| panic!("{PROMTOOL}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn prometheus_config_and_rules_check() {
    let out = promtool(&["check", "config", "prometheus.yml"], &dir());
    assert!(out.contains("SUCCESS"), "{out}");
    let out = promtool(&["check", "rules", "alerts.yml"], &dir());
    assert!(out.contains("rules found"), "{out}");
}

#[test]
fn alert_rule_unit_tests_pass() {
    let out = promtool(&["test", "rules", "alerts_test.yml"], &dir());
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn every_dashboard_query_parses() {
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(dir().join("../grafana/tether.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut n = 0;
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"]
                .as_str()
                .expect("expr")
                .replace("$__rate_interval", "5m")
                .replace("$__interval", "1m")
                .replace("$__range", "1h");
            rules.push_str(&format!(
                "      - record: dashboard:query{n}\n        expr: {}\n",
                serde_json::to_string(&expr).expect("JSON string is YAML")
            ));
            n += 1;
        }
    }
    assert!(n >= 20, "only {n} queries");
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::write(tmp.path().join("dashboard.yml"), rules).expect("write");
    let out = promtool(&["check", "rules", "dashboard.yml"], tmp.path());
    assert!(out.contains(&format!("{n} rules found")), "{out}");
}
