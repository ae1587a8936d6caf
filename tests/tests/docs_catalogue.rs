//! The metrics catalogue (`docs/metrics.md`) names every metric the services register: a new
//! metric without a catalogue entry fails this test, so the docs move with the code.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// String literals shaped like our metric names: `"tether_<component>_<rest>"`.
fn metric_names(src: &str) -> Vec<String> {
    const COMPONENTS: [&str; 6] = ["broker", "agent", "hub", "prober", "tls", "runtime"];
    let mut out = Vec::new();
    for lit in src.split('"').skip(1).step_by(2) {
        let Some(rest) = lit.strip_prefix("tether_") else {
            continue;
        };
        let component_ok = COMPONENTS
            .iter()
            .any(|c| rest.starts_with(&format!("{c}_")));
        if component_ok && lit.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
            out.push(lit.to_string());
        }
    }
    out
}

#[test]
fn every_registered_metric_is_catalogued() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let catalogue = std::fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let mut files = Vec::new();
    rust_files(&root.join("services"), &mut files);
    rust_files(&root.join("shared"), &mut files);
    let mut names: Vec<String> = files
        .iter()
        .flat_map(|f| metric_names(&std::fs::read_to_string(f).unwrap()))
        .collect();
    names.sort();
    names.dedup();
    assert!(
        names.len() > 40,
        "found only {} metric names; is the scan broken?",
        names.len()
    );
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !catalogue.contains(&format!("`{n}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics missing from docs/metrics.md: {missing:?}"
    );
}

#[test]
fn the_scan_finds_names_and_skips_other_literals() {
    let src = r#"let a = "tether_broker_tunnels"; let b = "tether_tunnel/1"; let c = "tether-x";"#;
    assert_eq!(metric_names(src), vec!["tether_broker_tunnels".to_string()]);
}
