//! `tether-tls-cost` runs end to end: both sides (receive, send) of a real TLS connection over
//! loopback move bytes with rustls's buffered and unbuffered APIs, and the table reports a CPU
//! cost per GB for each and their ratio. A smoke run with short transfers; the figures
//! themselves are judged in docs/benchmarks.md, not here.

use std::process::Command;
use std::time::Duration;

use tether_test_support::Child;

#[test]
fn both_sides_and_both_apis_are_measured_and_reported() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cmd = Command::new(tether_test_support::bin("tether-tls-cost")?);
    cmd.args(["--secs", "0.2", "--rounds", "2"]);
    let mut child = Child::spawn("tls-cost", cmd, dir.path())?;
    let status = child.wait_exit(Duration::from_secs(120))?;
    let out = std::fs::read_to_string(child.log_path())?;
    assert!(
        status.success(),
        "tether-tls-cost failed ({status}):\n{out}"
    );
    for side in ["receive", "send"] {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("| {side} |")))
            .unwrap_or_else(|| panic!("no row for {side} in:\n{out}"));
        // | side | buffered | unbuffered | ratio [range, from two rounds] |
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let number = |cell: &str| -> f64 {
            cell.split('×')
                .next()
                .unwrap_or_default()
                .parse()
                .unwrap_or_else(|e| panic!("{side}: {cell:?} is not a figure ({e}) in {row}"))
        };
        for (i, what) in [(2, "buffered"), (3, "unbuffered"), (4, "ratio")] {
            let v = number(cells[i]);
            assert!(
                v.is_finite() && v > 0.0,
                "{side}: no {what} figure in {row}"
            );
        }
    }
    Ok(())
}
