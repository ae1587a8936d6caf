#!/usr/bin/env bash
# The test command of README.md: builds every binary the end-to-end tests start as real
# processes, then runs every test of the workspace (unit, integration, end-to-end, doc tests).
# Needs the system packages of scripts/install-deps.sh (nats-server, squid, tinyproxy, …).
#
# With cargo-nextest installed (the CI machine has it) the tests run under nextest, two at a
# time across test binaries (.config/nextest.toml says which run alone), and the doc tests with
# `cargo test --doc`; without it, or with TETHER_CARGO_TEST=1, `cargo test` runs everything.
# Arguments go to the test runner (a filter, for example).
set -euo pipefail
cd "$(dirname "$0")/.."
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
cargo build --workspace --bins
if [ -z "${TETHER_CARGO_TEST:-}" ] && cargo nextest --version >/dev/null 2>&1; then
  status=0
  cargo nextest run --workspace --no-fail-fast "$@" || status=$?
  cargo test --workspace --doc "$@" || status=$?
  exit "$status"
fi
cargo test --workspace --no-fail-fast "$@"
