#!/usr/bin/env bash
# Bounded live fuzz run of every cargo-fuzz target (docs/fuzzing.md). CI (.ci/run) runs it with
# 10 s per target after the tests; the tests also replay the committed corpora
# (tests/tests/fuzz_corpus.rs).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 60 s, every target)
#
# TETHER_FUZZ_BUILD picks the build: `-O` (default; optimised, with debug assertions) or `--dev`
# (unoptimised: builds in a fraction of the time, runs fewer inputs per second; what CI uses, where
# the build dominates a 10 s run).
# Needs cargo-fuzz (scripts/install-deps.sh installs the pinned version); runs on stable via RUSTC_BOOTSTRAP=1.
# New inputs go to fuzz/target/work-corpus/<target>/ (not committed); the committed seeds in
# fuzz/corpus/<target>/ are read only. Crashes land in fuzz/artifacts/<target>/: minimise one
# (`cargo fuzz tmin <target> <file>`), fix the parser, and commit the input under
# fuzz/regressions/<target>/ so the replay test keeps it fixed. Exits non-zero on any crash.
set -euo pipefail
secs="${1:-60}"
shift || true
cd "$(dirname "$0")/../fuzz"
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz missing: cargo install cargo-fuzz --locked" >&2; exit 2; }
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list)
fi
build="${TETHER_FUZZ_BUILD:--O}"
case "$build" in -O|--dev) ;; *) echo "TETHER_FUZZ_BUILD must be -O or --dev, not '$build'" >&2; exit 2;; esac
cargo fuzz build "$build"
logs="target/fuzz-logs"
mkdir -p "$logs"
printf '%-22s %12s %10s %8s %8s %7s %s\n' target executions exec/s cov ft secs result
failed=0
for t in "${targets[@]}"; do
  mkdir -p "target/work-corpus/$t"
  start=$(date +%s)
  if cargo fuzz run "$build" "$t" "target/work-corpus/$t" "corpus/$t" -- \
      -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      >"$logs/$t.log" 2>&1; then
    result=ok
  else
    result="CRASH (fuzz/artifacts/$t, log $PWD/$logs/$t.log)"
    failed=1
  fi
  took=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$logs/$t.log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$logs/$t.log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  printf '%-22s %12s %10s %8s %8s %7s %s\n' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "$took" "$result"
done
exit "$failed"
