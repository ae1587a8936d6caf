//! Fuzz regression replay without cargo-fuzz: every committed corpus file
//! (`fuzz/corpus/<target>/`) and every crash kept as a regression (`fuzz/regressions/<target>/`)
//! goes through the same harness function the fuzz target calls (`fuzz/src/lib.rs`, included
//! here as a module), so CI replays them in seconds. docs/fuzzing.md.
//!
//! Run: `cargo test -p tether-e2e --test fuzz_corpus`.

#[path = "../../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod harness;

use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `dir` (none if it does not exist), sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.is_file());
    v.sort();
    v
}

#[test]
fn every_corpus_and_regression_file_replays_without_a_panic() {
    let started = std::time::Instant::now();
    let mut total = 0;
    for (name, run) in harness::TARGETS {
        let corpus = files(&fuzz_dir().join("corpus").join(name));
        let regressions = files(&fuzz_dir().join("regressions").join(name));
        assert!(
            !corpus.is_empty(),
            "fuzz/corpus/{name}/ has no seed files (every target is seeded)"
        );
        for f in corpus.iter().chain(&regressions) {
            let data = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if std::panic::catch_unwind(|| run(&data)).is_err() {
                panic!("{name}: {} panics", f.display());
            }
        }
        println!(
            "{name}: {} corpus files, {} regressions",
            corpus.len(),
            regressions.len()
        );
        total += corpus.len() + regressions.len();
    }
    println!("replayed {total} files in {:.2?}", started.elapsed());
}

/// The harness itself can fail: a target whose parser output does not round-trip panics.
#[test]
fn harness_checks_can_fail() {
    // A well-formed head with an unknown token: parsed, credentials refused, no panic.
    harness::connect_head(b"CONNECT c1:443 HTTP/1.1\r\nProxy-Authorization: Bearer x\r\n\r\n");
    let broken = std::panic::catch_unwind(|| {
        // A target the agent would rebuild differently (hosts are lower-cased on the wire).
        harness::round_trip(&tether_tunnel::Target::host_port("c1", "Upper.Case", 80));
    });
    assert!(broken.is_err(), "a non-round-tripping target is caught");
}
