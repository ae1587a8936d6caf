//! Shared by the Helm tests (`helm_charts.rs`, `helm_docker.rs`, `deploy_artifacts.rs`): the
//! real `helm` binary (scripts/install-deps.sh installs it; absent: the tests say so and skip),
//! a copy of `helm/` with the umbrella chart's `file://` dependencies built from the current
//! subchart sources, and the rendered manifests as JSON values.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// The charts of the repository.
pub const CHARTS: [&str; 4] = ["tether", "tether-hub", "tether-agent", "tether-nats"];

/// Whether `program --version`-like `args` runs; prints why a test skips when not.
pub fn have(program: &str, args: &[&str]) -> bool {
    let ok = Command::new(program)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "SKIPPED: `{program}` is not installed or does not run (scripts/install-deps.sh installs it)"
        );
    }
    ok
}

/// Runs a command; Ok(stdout) or Err(stderr + stdout).
pub fn run(cmd: &mut Command) -> Result<String, String> {
    let o = cmd
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    if o.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{cmd:?} failed ({}):\n{}{out}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        ))
    }
}

/// A temporary copy of `helm/` whose umbrella chart has its dependencies built
/// (`helm dependency build`: offline, `file://` subcharts) from the current sources.
pub struct Charts {
    pub dir: tempfile::TempDir,
}

impl Charts {
    pub fn build() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        run(Command::new("cp")
            .arg("-r")
            .arg(root().join("helm"))
            .arg(dir.path()))
        .expect("copy helm/");
        let charts = Self { dir };
        let umbrella = charts.chart("tether");
        let _ = std::fs::remove_dir_all(umbrella.join("charts"));
        run(Command::new("helm")
            .args(["dependency", "build"])
            .arg(&umbrella))
        .expect("helm dependency build");
        charts
    }

    pub fn chart(&self, name: &str) -> PathBuf {
        self.dir.path().join("helm").join(name)
    }

    /// `helm template <release> <chart> -n <ns> [-f values] [--set ...]`.
    pub fn template(
        &self,
        chart: &str,
        release: &str,
        ns: &str,
        values: Option<&Path>,
        sets: &[&str],
    ) -> Result<String, String> {
        let mut c = Command::new("helm");
        c.args(["template", release])
            .arg(self.chart(chart))
            .args(["--namespace", ns]);
        if let Some(v) = values {
            c.arg("-f").arg(v);
        }
        for s in sets {
            c.args(["--set", s]);
        }
        run(&mut c)
    }
}

/// The documents of a multi-document YAML stream (empty documents dropped).
pub fn docs(yaml: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(yaml)
        .unwrap_or_else(|e| panic!("rendered YAML does not parse: {e}\n{yaml}"))
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

/// The object of `kind` named `name`.
pub fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

/// (kind/name, pod template spec, pod labels) of every workload.
pub fn pods(docs: &[Value]) -> Vec<(String, Value, Value)> {
    docs.iter()
        .filter(|d| {
            matches!(
                d["kind"].as_str(),
                Some("Deployment" | "StatefulSet" | "Job" | "DaemonSet")
            )
        })
        .map(|d| {
            (
                format!(
                    "{}/{}",
                    d["kind"].as_str().unwrap_or_default(),
                    d["metadata"]["name"].as_str().unwrap_or_default()
                ),
                d["spec"]["template"]["spec"].clone(),
                d["spec"]["template"]["metadata"]["labels"].clone(),
            )
        })
        .collect()
}

/// The data of a ConfigMap (string values).
pub fn config_data(docs: &[Value], name: &str) -> serde_json::Map<String, Value> {
    find(docs, "ConfigMap", name)["data"]
        .as_object()
        .cloned()
        .unwrap_or_default()
}
