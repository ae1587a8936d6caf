#!/usr/bin/env bash
# The main job of README.md: installs what is needed, builds, and runs the local demo — a hub
# broker and an agent for a simulated managed cluster, with a request going through the tunnel.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo build --workspace --bins
exec ./target/debug/tether-demo "$@"
