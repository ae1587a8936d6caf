//! `tether-bench` runs end to end: a quick run of its latency sections starts the real broker,
//! agent, target, relays and whichever encrypted peers are installed (`ssh -R` from
//! scripts/install-deps.sh; rathole only where scripts/install-bench-peers.sh ran), measures
//! every path and prints a figure for each in the table; a quick run of the `peers` section
//! measures dials relayed by two more brokers over `tether-relay/2` and `/1`; a quick run of the
//! `clients` section moves bytes on every client path (CONNECT, TLS CONNECT, the SDK, `tetherctl
//! proxy connect`, konnectivity, each where it applies on both client ports) both ways; a quick run
//! of the `sproxy` section answers requests through the service proxy, CONNECT kept alive and a
//! new tunnel per request, and downloads the large LIST each way. Smoke runs: the
//! figures themselves are judged in docs/benchmarks.md, not here (this keeps the bench from
//! rotting between the sessions that run it).

use std::process::Command;
use std::time::Duration;

use tether_test_support::Child;

/// The output of `tether-bench --quick --only <sections>`, which must succeed.
fn quick_run(sections: &str) -> anyhow::Result<String> {
    quick_run_with(sections, &[])
}

/// [`quick_run`] with more options.
fn quick_run_with(sections: &str, extra: &[&str]) -> anyhow::Result<String> {
    let dir = tempfile::tempdir()?;
    let mut cmd = Command::new(tether_test_support::bin("tether-bench")?);
    cmd.args(["--quick", "--only", sections]).args(extra);
    let mut child = Child::spawn("bench", cmd, dir.path())?;
    let status = child.wait_exit(Duration::from_secs(240))?;
    let out = std::fs::read_to_string(child.log_path())?;
    assert!(status.success(), "tether-bench failed ({status}):\n{out}");
    Ok(out)
}

#[test]
fn the_latency_sections_measure_every_path() -> anyhow::Result<()> {
    let out = quick_run("rr,open")?;
    let cells =
        |line: &str| -> Vec<String> { line.split('|').map(|c| c.trim().to_string()).collect() };
    let header = out
        .lines()
        .find(|l| l.starts_with("| measurement"))
        .unwrap_or_else(|| panic!("no table in:\n{out}"));
    let head = cells(header);
    let column = |name: &str| {
        head.iter()
            .position(|c| c == name)
            .unwrap_or_else(|| panic!("no column {name:?} in {header}"))
    };
    let peers = [
        ("ssh -R", "ssh -R peer skipped"),
        ("rathole tls", "rathole tls peer skipped"),
    ];
    for what in [
        "64 B request/response p50",
        "new stream, open → first byte p50",
        "new stream, pipelined CONNECT → first byte p50",
    ] {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("| {what} ")))
            .unwrap_or_else(|| panic!("no row {what:?} in:\n{out}"));
        let c = cells(row);
        let figure = |col: &str| -> f64 {
            let cell = &c[column(col)];
            cell.trim_end_matches(" µs")
                .parse()
                .unwrap_or_else(|e| panic!("{what}, {col}: {cell:?} is not a figure ({e})"))
        };
        for path in ["direct", "relay ×2", "tunnel"] {
            assert!(figure(path) > 0.0, "{what}: no {path} figure in {row}");
        }
        // A peer that runs has a figure; one that is not installed says why, once, up front.
        for (peer, skipped) in peers {
            if out.contains(skipped) {
                assert!(
                    c[column(peer)].is_empty(),
                    "{what}: {peer} skipped but has a figure"
                );
            } else {
                assert!(figure(peer) > 0.0, "{what}: no {peer} figure in {row}");
            }
        }
    }
    Ok(())
}

#[test]
fn relayed_dials_are_measured_on_both_relay_protocols() -> anyhow::Result<()> {
    let out = quick_run("peers")?;
    for (what, unit) in [
        ("relayed CONNECT via a peer broker, 1 stream", " Gbit/s"),
        ("relayed CONNECT, 64 B request/response", " µs"),
        ("relayed CONNECT, open → first byte (pipelining)", " µs"),
    ] {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("| {what} ")))
            .unwrap_or_else(|| panic!("no row {what:?} in:\n{out}"));
        // The tunnel cell: "[p50 ]relay/2 X<unit>, relay/1 Y<unit>, unrelayed Z<unit>".
        for path in ["relay/2 ", "relay/1 ", "unrelayed "] {
            let figure = row
                .split(path)
                .nth(1)
                .and_then(|rest| rest.split(unit).next())
                .and_then(|n| n.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{what}: no {path}figure in {row}"));
            assert!(figure > 0.0, "{what}: {path}{figure} in {row}");
        }
    }
    Ok(())
}

/// The client paths every `clients` and `client-rr` run measures (the floors aside), as their
/// rows name them.
const CLIENT_PATHS: [&str; 8] = [
    "CONNECT",
    "TLS CONNECT",
    "gRPC Dial (SDK)",
    "tetherctl proxy connect",
    "gRPC Dial (SDK), plain port",
    "tetherctl proxy connect, plain port",
    "konnectivity",
    "konnectivity, plain port",
];

#[test]
fn every_client_path_moves_data_both_ways() -> anyhow::Result<()> {
    let out = quick_run("clients")?;
    let gbit = |cell: &str| -> Option<f64> { cell.trim().strip_suffix(" Gbit/s")?.parse().ok() };
    for path in CLIENT_PATHS {
        let what = format!("| client path: {path}, 1 / 8 streams ");
        let row = out
            .lines()
            .find(|l| l.starts_with(&what))
            .unwrap_or_else(|| panic!("no row for {path:?} in:\n{out}"));
        // The tunnel cell: "X Gbit/s / Y Gbit/s" (1 and 8 streams, uploads).
        let cell = row
            .split('|')
            .find(|c| c.contains(" Gbit/s / "))
            .unwrap_or_else(|| panic!("{path}: no throughput in {row}"));
        for figure in cell.split(" / ") {
            let g = gbit(figure).unwrap_or_else(|| panic!("{path}: {figure:?} in {row}"));
            assert!(g > 0.0, "{path}: {figure} in {row}");
        }
    }
    // Downloads: one row, every path's throughput against CONNECT's.
    let row = out
        .lines()
        .find(|l| l.starts_with("| client paths, download "))
        .unwrap_or_else(|| panic!("no download row in:\n{out}"));
    for path in [
        "gRPC Dial (SDK): ",
        "konnectivity: ",
        "konnectivity, plain port: ",
    ] {
        let ratio: f64 = row
            .split(path)
            .nth(1)
            .and_then(|r| r.strip_prefix("throughput "))
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("download: no {path}figure in {row}"));
        assert!(ratio > 0.0, "download {path}{ratio} in {row}");
    }
    Ok(())
}

#[test]
fn a_focused_run_measures_the_chosen_paths_against_connect() -> anyhow::Result<()> {
    let out = quick_run_with(
        "clients",
        &[
            "--client-paths",
            "konnectivity-plain",
            "--client-direction",
            "download",
        ],
    )?;
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("| client path"))
        .collect();
    let names: Vec<&str> = rows
        .iter()
        .filter_map(|r| r.split('|').nth(1).map(str::trim))
        .collect();
    assert_eq!(
        names,
        [
            "client path download: CONNECT, 1 / 8 streams",
            "client path download: konnectivity, plain port, 1 / 8 streams"
        ],
        "only CONNECT and the chosen path, downloads only:\n{out}"
    );
    for row in rows {
        // "…; broker X, agent Y CPU-s/GB, …" for 1 and for 8 streams.
        let figures: Vec<f64> = ["broker ", "agent "]
            .iter()
            .flat_map(|k| row.split(k).skip(1))
            .filter_map(|r| r.split([',', ' ']).next()?.parse().ok())
            .collect();
        assert_eq!(figures.len(), 4, "broker and agent, 1 and 8 streams: {row}");
        assert!(figures.iter().all(|f| *f > 0.0), "{row}");
    }
    Ok(())
}

#[test]
fn every_client_path_answers_requests() -> anyhow::Result<()> {
    let out = quick_run("client-rr")?;
    let row = out
        .lines()
        .find(|l| l.starts_with("| client paths, 64 B request/response "))
        .unwrap_or_else(|| panic!("no request/response row in:\n{out}"));
    for path in CLIENT_PATHS {
        // The result cell: "<path> P50 / P99 µs[, ±N µs vs <floor>], CPU per round trip X µs
        // (broker+agent Y)", one per path, joined by "; ".
        let result = row.split('|').nth(7).unwrap_or_default();
        let cell = result
            .split("; ")
            .map(str::trim)
            .find(|c| {
                c.strip_prefix(path)
                    .and_then(|r| r.strip_prefix(' '))
                    .is_some_and(|r| r.starts_with(|d: char| d.is_ascii_digit()))
            })
            .unwrap_or_else(|| panic!("no {path:?} figure in {result}"));
        let figures: Vec<f64> = cell[path.len()..]
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter_map(|f| f.parse().ok())
            .collect();
        // p50, p99, and (after the comparison for paths that have one) the CPU figures.
        assert!(figures.len() >= 4, "{path}: {cell}");
        assert!(
            figures[0] > 0.0 && figures[1] >= figures[0],
            "{path}: {cell}"
        );
        assert!(figures[figures.len() - 2] > 0.0, "{path}: CPU in {cell}");
    }
    Ok(())
}

/// The figures after `way` in a detail line, up to the next `;`: every word of that part that
/// is a number ("p50" and "µs" are not).
fn figures_after(line: &str, way: &str) -> Vec<f64> {
    let part = line
        .split(way)
        .nth(1)
        .unwrap_or_else(|| panic!("no {way:?} in {line}"));
    part.split(';')
        .next()
        .unwrap_or_default()
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter_map(|f| f.parse().ok())
        .collect()
}

#[test]
fn the_service_proxy_section_measures_every_way() -> anyhow::Result<()> {
    let out = quick_run("sproxy")?;
    let line = |start: &str| {
        out.lines()
            .map(str::trim_start)
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} line in:\n{out}"))
    };
    // "GET /version, 4 clients: service proxy R req/s, p50 A µs / p99 B µs; CONNECT kept alive
    // …; CONNECT + TLS per request …; API server saw C TLS connections for N requests".
    let get = line("GET /version, ");
    for way in [
        ": service proxy ",
        "; CONNECT kept alive ",
        "; CONNECT + TLS per request ",
    ] {
        let f = figures_after(get, way);
        assert!(f.len() == 3, "{way}: {get}");
        assert!(f[0] > 0.0 && f[1] > 0.0 && f[2] >= f[1], "{way}: {get}");
    }
    // The per-request way opens a TLS connection to the API server for each request; the other
    // two keep theirs, so the server saw fewer connections than requests.
    let seen = figures_after(get, "API server saw ");
    assert!(seen.len() == 2 && seen[0] >= 1.0, "{get}");
    assert!(seen[0] < seen[1], "no connection was reused: {get}");
    // "large LIST (S MiB), one client: service proxy h2 X Gbit/s, h1 Y Gbit/s; …; CONNECT kept
    // alive h2 X Gbit/s, h1 Y Gbit/s; …".
    let list = line("large LIST (");
    for way in [": service proxy ", "; CONNECT kept alive "] {
        let rates = figures_after(list, way);
        assert!(rates.len() == 2, "{way}: {list}");
        assert!(rates.iter().all(|r| *r > 0.0), "{way}: {list}");
    }
    Ok(())
}
