//! `tether-frame-cost` runs end to end: every framing (plain TCP, TLS, HTTP/2 over TLS and the
//! minimal multiplexer over TLS) completes its round trips over real loopback sockets and real
//! TLS, and the table reports a latency and a CPU cost for each. A smoke run with few messages;
//! the figures themselves are judged in docs/benchmarks.md, not here.

use std::process::Command;
use std::time::Duration;

use tether_test_support::Child;

#[test]
fn every_framing_completes_and_is_reported() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cmd = Command::new(tether_test_support::bin("tether-frame-cost")?);
    cmd.args(["--messages", "300", "--rounds", "2"]);
    let mut child = Child::spawn("frame-cost", cmd, dir.path())?;
    let status = child.wait_exit(Duration::from_secs(120))?;
    let out = std::fs::read_to_string(child.log_path())?;
    assert!(
        status.success(),
        "tether-frame-cost failed ({status}):\n{out}"
    );
    for framing in ["tcp", "tls", "h2", "mux"] {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("| {framing} |")))
            .unwrap_or_else(|| panic!("no row for {framing} in:\n{out}"));
        // | name | p50 µs | p99 µs | CPU µs | vs |
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let number = |cell: &str| -> f64 {
            cell.trim_end_matches(" µs")
                .parse()
                .unwrap_or_else(|e| panic!("{framing}: {cell:?} is not a figure ({e}) in {row}"))
        };
        assert!(
            number(cells[2]) > 0.0,
            "{framing}: no round trip time in {row}"
        );
        assert!(
            number(cells[4]) > 0.0,
            "{framing}: no CPU per round trip in {row}"
        );
    }
    // The summary gives each layer's CPU over TLS as a signed figure.
    let summary = out
        .lines()
        .find_map(|l| l.strip_prefix("HTTP/2 over TLS: "))
        .unwrap_or_else(|| panic!("no layer summary in:\n{out}"));
    let figure = summary.split(' ').next().unwrap_or("");
    assert!(
        figure.parse::<f64>().is_ok_and(f64::is_finite),
        "HTTP/2's CPU over TLS {figure:?} is not a figure in: {summary}"
    );
    Ok(())
}
