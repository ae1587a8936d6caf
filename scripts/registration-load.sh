#!/usr/bin/env bash
# Load run: N simulated managed clusters (one registration-agent process, one NATS connection
# and credential set per cluster) join one hub with auto-accept and keep their leases.
# Reports time until all are Joined, then CPU of nats-server and addon-manager and the NATS
# message rate over a steady window. Loopback only; every process is stopped at the end.
#
#   scripts/registration-load.sh [CLUSTERS=1000] [LEASE_SECONDS=10] [WINDOW_SECONDS=60]
# Env: BIN_DIR (default target/release), NATS_SERVER (default: nats-server on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
LEASE=${2:-10}
WINDOW=${3:-60}
BIN=${BIN_DIR:-target/release}
NATS=${NATS_SERVER:-$(command -v nats-server)}
ulimit -n 65536 2>/dev/null || true
WORK=$(mktemp -d /tmp/tether-load.XXXXXX)
PIDS=()
cleanup() {
  # Stop in reverse start order (agents, hub, NATS), each by its PID.
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill "${PIDS[$i]}" 2>/dev/null || true; done
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do wait "${PIDS[$i]}" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

"$BIN/tetherctl" init --dir "$WORK/hub" --hub-host hub.tether.test --nats-listen 127.0.0.1:-1 \
  --nats-http 127.0.0.1:-1 --ports-file-dir "$WORK" --auto-accept '*' \
  --lease-duration-seconds "$LEASE" --lease-check-interval 1s >/dev/null
"$NATS" -c "$WORK/hub/nats/nats.conf" >"$WORK/nats.log" 2>&1 &
NATS_PID=$!; PIDS+=("$NATS_PID")
for _ in $(seq 1 200); do [ -f "$WORK/nats-server_${NATS_PID}.ports" ] && break; sleep 0.05; done
PORTS=$(cat "$WORK/nats-server_${NATS_PID}.ports")
NPORT=$(python3 -c "import json,sys;print(json.loads(sys.argv[1])['nats'][0].rsplit(':',1)[1])" "$PORTS")
MON=$(python3 -c "import json,sys;print(json.loads(sys.argv[1])['monitoring'][0])" "$PORTS")
URL="tls://127.0.0.1:$NPORT"
RUST_LOG=warn "$BIN/addon-manager" --hub-dir "$WORK/hub" --nats-url "$URL" --ready-file "$WORK/am.ready" >"$WORK/am.log" 2>&1 &
AM_PID=$!; PIDS+=("$AM_PID")
for _ in $(seq 1 400); do [ -f "$WORK/am.ready" ] && break; sleep 0.05; done
"$BIN/tetherctl" join --hub-server "$URL" --hub-ca "$WORK/hub/ca.crt" --tls-server-name hub.tether.test \
  --token "$(cat "$WORK/hub/bootstrap.token")" --out "$WORK/boot.kubeconfig" 2>/dev/null

START=$(date +%s.%N)
RUST_LOG=warn "$BIN/registration-agent" --cluster-name sim --simulate "$N" \
  --bootstrap-kubeconfig "$WORK/boot.kubeconfig" --hub-kubeconfig-dir "$WORK/creds" \
  --check-interval 5s >"$WORK/agents.log" 2>&1 &
AG_PID=$!; PIDS+=("$AG_PID")

joined() {
  "$BIN/tetherctl" get clusters -o json --hub-dir "$WORK/hub" --nats-url "$URL" 2>/dev/null |
    python3 -c "import json,sys
d=json.load(sys.stdin)
print(sum(1 for c in d['items'] if any(x['type']=='ManagedClusterConditionAvailable' and x['status']=='True' for x in c['status']['conditions'])))" 2>/dev/null || echo 0
}
DEADLINE=$(( $(date +%s) + 600 ))
while :; do
  J=$(joined)
  [ "$J" -ge "$N" ] && break
  if [ "$(date +%s)" -gt "$DEADLINE" ]; then echo "only $J of $N clusters Available after 600 s" >&2; exit 1; fi
  sleep 1
done
END=$(date +%s.%N)
echo "clusters=$N lease=${LEASE}s all Available in $(python3 -c "print(f'{$END-$START:.1f}')") s"

ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
varz() { python3 -c "import json,urllib.request,sys;v=json.load(urllib.request.urlopen(sys.argv[1]+'/varz'));print(v['in_msgs'],v['out_msgs'],v['connections'],v['mem'])" "$MON"; }
HZ=$(getconf CLK_TCK)
read -r IN0 OUT0 _ _ <<<"$(varz)"
N0=$(ticks "$NATS_PID"); A0=$(ticks "$AM_PID"); G0=$(ticks "$AG_PID")
sleep "$WINDOW"
read -r IN1 OUT1 CONNS MEM <<<"$(varz)"
N1=$(ticks "$NATS_PID"); A1=$(ticks "$AM_PID"); G1=$(ticks "$AG_PID")
python3 - "$WINDOW" "$HZ" "$N0" "$N1" "$A0" "$A1" "$G0" "$G1" "$IN0" "$IN1" "$OUT0" "$OUT1" "$CONNS" "$MEM" "$AM_PID" <<'PY'
import sys
w, hz = float(sys.argv[1]), float(sys.argv[2])
n0, n1, a0, a1, g0, g1, i0, i1, o0, o1 = map(float, sys.argv[3:13])
conns, mem, am = sys.argv[13], int(sys.argv[14]), sys.argv[15]
rss = int(open(f"/proc/{am}/status").read().split("VmRSS:")[1].split()[0]) // 1024
print(f"steady window {w:.0f} s: nats-server CPU {100*(n1-n0)/hz/w:.1f}% of one core, "
      f"addon-manager CPU {100*(a1-a0)/hz/w:.1f}% (RSS {rss} MiB), "
      f"{sys.argv[1] and ''}simulated agents CPU {100*(g1-g0)/hz/w:.1f}%")
print(f"NATS: {(i1-i0)/w:.0f} msgs/s in, {(o1-o0)/w:.0f} msgs/s out, {conns} connections, server RSS {mem//(1<<20)} MiB")
PY
