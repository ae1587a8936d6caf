#!/usr/bin/env bash
# Installs the benchmark peers that are not Debian packages (tether-bench only; the tests do not
# need them): rathole 0.5.0, the Rust reverse tunnel, built from crates.io with its default
# features (TLS through native-tls/OpenSSL, Noise). About 2 minutes on 2 cores; idempotent.
#   bash scripts/install-bench-peers.sh
# Installs into cargo's bin directory (~/.cargo/bin), where tether-bench looks after
# $TETHER_BENCH_RATHOLE and PATH. `ssh -R` and stunnel come from scripts/install-deps.sh.
set -euo pipefail

RATHOLE_VERSION="0.5.0"

if ! dpkg-query -W -f='${Status}' libssl-dev 2>/dev/null | grep -q "install ok installed" \
  || ! dpkg-query -W -f='${Status}' pkg-config 2>/dev/null | grep -q "install ok installed"; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=300 libssl-dev pkg-config
fi

have="$(rathole --version 2>/dev/null || "${CARGO_HOME:-$HOME/.cargo}/bin/rathole" --version 2>/dev/null || true)"
if [[ "$have" == *"$RATHOLE_VERSION"* ]]; then
  echo "install-bench-peers: rathole $RATHOLE_VERSION already installed"
else
  # Not --locked: its lock file pins time 0.3.29, which no longer compiles on current Rust.
  cargo install rathole --version "$RATHOLE_VERSION"
fi
echo "install-bench-peers: rathole $( ("${CARGO_HOME:-$HOME/.cargo}/bin/rathole" --version 2>/dev/null || rathole --version) | sed -n "s/^Build Version: *//p")"
