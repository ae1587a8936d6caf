#!/usr/bin/env bash
# The main job of README.md: installs what is needed, builds, and runs the local demo — a hub
# (NATS + addon-manager, two brokers, a health-prober on NATS) and two simulated managed clusters
# behind a forward proxy, each running the real add-on chain (registration-agent --addon
# cluster-proxy supervising a tunnel-agent); prints the `tetherctl proxy health` table, a request
# reaching a service in each cluster, and the table after one cluster's agent stops (about 15 s
# after the build; `--loopback` skips the network namespaces used as root; Ctrl-C cleans up).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo build --workspace --bins
exec ./target/debug/tether-demo "$@"
