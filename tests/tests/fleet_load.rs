//! Smoke run of `tether-fleet-load` (the scale tool of docs/scale.md): 20 simulated clusters
//! against a real 3-node NATS hub and addon-manager, with a 2 s lease so a short window sees
//! renewals. Checks the report's figures are real (every cluster joined, Available, renewing,
//! no flap, the table lists them all) and that every hub process it started is gone at the end.

use std::process::Command;

use tether_test_support::bin;

const CLUSTERS: u64 = 20;

#[test]
fn fleet_load_joins_renews_and_stops_its_hub() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let out = Command::new(bin("tether-fleet-load").unwrap())
        .args(["--clusters", &CLUSTERS.to_string()])
        .args(["--lease-duration-seconds", "2", "--window-seconds", "5"])
        .args(["--ramp-timeout-seconds", "120"])
        .arg("--work-dir")
        .arg(dir.path().join("work"))
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tether-fleet-load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["joined"], CLUSTERS, "{r:#}");
    assert_eq!(r["available"], CLUSTERS, "{r:#}");
    assert_eq!(r["unknown_or_flapped"], 0, "{r:#}");
    assert_eq!(r["get_clusters_rows"], CLUSTERS, "{r:#}");
    assert_eq!(r["lease_renewals_error"], 0, "{r:#}");
    // A 2 s lease (+ up to 25 % jitter) over a 5 s window: every cluster renews at least once.
    assert!(
        r["lease_renewals_ok"].as_u64().unwrap() >= CLUSTERS,
        "{r:#}"
    );
    assert!(r["lease_renew_seconds"]["p99"].as_f64().is_some(), "{r:#}");
    for p in ["addon-manager", "nats-1", "nats-2", "nats-3"] {
        assert!(
            r["processes"][p]["rss_mib"].as_f64().unwrap() > 0.0,
            "{p}: {r:#}"
        );
    }
    // Every node's /varz was read at both ends of the window (monitoring on random ports).
    for n in ["nats-1", "nats-2", "nats-3"] {
        assert!(
            r["nats_rates"][n]["in_msgs_per_s"].as_f64().unwrap() > 0.0,
            "{n}: {r:#}"
        );
        assert!(
            r["nats_rates"][n]["js_api_per_s"].as_f64().is_some(),
            "{n}: {r:#}"
        );
    }
    for pid in r["hub_pids"].as_array().unwrap() {
        let pid = pid.as_u64().unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "hub process {pid} still running after the tool exited"
        );
    }
}
