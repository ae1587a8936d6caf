#!/usr/bin/env bash
# The test command of README.md: builds every binary the end-to-end tests start as real
# processes, then runs every test of the workspace (unit, integration, end-to-end).
# Needs the system packages of scripts/install-deps.sh (nats-server, squid, tinyproxy, …).
set -euo pipefail
cd "$(dirname "$0")/.."
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
cargo build --workspace --bins
cargo test --workspace --no-fail-fast "$@"
