#!/usr/bin/env bash
# Issues the hub's data-plane certificates from the hub CA that `tetherctl init` wrote:
#   broker-b1, broker-b2: CN tether:broker:<id>, serverAuth+clientAuth (peer relays), SANs =
#                         the names agents and peers dial (broker-<id>, localhost)
#   health-prober:        CN tether:client:health-prober, clientAuth (a static broker client)
# Output: compose/certs/ (mounted at /etc/tether/certs). Keys are 0600 and never committed.
# Usage: bash compose/issue-certs.sh [HUB_DIR] [OUT_DIR]   (defaults: compose/hub-dir compose/certs)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hub=${1:-$here/hub-dir}
out=${2:-$here/certs}
days=${TETHER_CERT_DAYS:-90}
mkdir -p "$out"
umask 077

issue() { # name cn eku sans
  local name=$1 cn=$2 eku=$3 sans=$4 ext
  ext=$(mktemp)
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=$eku"
    [ -n "$sans" ] && echo "subjectAltName=$sans"
  } >"$ext"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$out/$name.key"
  openssl req -new -key "$out/$name.key" -subj "/CN=$cn" -out "$out/$name.csr"
  openssl x509 -req -in "$out/$name.csr" -CA "$hub/ca.crt" -CAkey "$hub/ca.key" \
    -CAcreateserial -CAserial "$out/ca.srl" -days "$days" -sha256 -extfile "$ext" \
    -out "$out/$name.crt" 2>/dev/null
  rm -f "$out/$name.csr" "$ext"
  chmod 0644 "$out/$name.crt"
  echo "issued $out/$name.crt ($cn)"
}

for id in b1 b2; do
  issue "broker-$id" "tether:broker:$id" serverAuth,clientAuth "DNS:broker-$id,DNS:localhost,IP:127.0.0.1"
done
issue health-prober "tether:client:health-prober" clientAuth ""
# Containers run as uid 10001; let it read the keys (the directory is only mounted read-only).
chmod 0644 "$out"/*.key 2>/dev/null || true
