#!/usr/bin/env bash
# The main job of README.md: installs what is needed, builds, and runs the local demo — a hub
# (NATS + addon-manager, two brokers, a health-prober on NATS) and two simulated managed clusters
# behind a forward proxy; prints the `tetherctl proxy health` table and a request reaching a
# service in each cluster (about 10 s after the build).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo build --workspace --bins
exec ./target/debug/tether-demo "$@"
