#!/bin/sh
# One-shot `init` service (compose/compose.yaml): everything the stack needs on disk, created
# once and kept on later runs (idempotent; nothing secret is in the repository or the images).
#   /etc/tether/hub    hub directory: CA, nats.conf, credentials, bootstrap token (tetherctl init;
#                      edge-1 and edge-2 auto-accepted)
#   /etc/tether/certs  what hub processes other than NATS and addon-manager may see: broker and
#                      prober certificates, the hub CA certificate, the tether-hub password, and
#                      the simulated clusters' CA certificate (sim-ca.crt, for the prober)
#   /etc/tether/sim    the simulated managed clusters: their own CA (a second `tetherctl init`,
#                      standing in for each cluster's CA), API-server stand-in certificates,
#                      edge-2's HTTPS proxy certificate and basic-auth files, and each cluster's
#                      bootstrap kubeconfig (tetherctl join, through its proxy)
set -eu
# Directories 0750 (group 65532: squid-edge-2 runs with that supplementary group to read its key
# and password hashes); keys are written 0600 by tetherctl unless --key-mode says otherwise.
umask 027
hub=/etc/tether/hub certs=/etc/tether/certs sim=/etc/tether/sim

if [ ! -f "$hub/hub.yaml" ]; then
  tetherctl init --dir "$hub" --hub-host nats --hub-nats-url tls://nats:4222 \
    --store-dir /data/jetstream --nats-http 0.0.0.0:8222 --admin-listen 0.0.0.0:9440 \
    --auto-accept edge-1 --auto-accept edge-2 >/dev/null
  echo "init: hub directory created"
fi

# Broker and prober certificates from the hub CA (kept while at least half their life is left).
for id in b1 b2; do
  tetherctl cert issue --dir "$hub" --identity "broker:$id" --san "broker-$id" --san localhost \
    --out "$certs" --if-valid
done
tetherctl cert issue --dir "$hub" --identity client:health-prober --out "$certs" --if-valid
cp "$hub/ca.crt" "$certs/ca.crt"
cp "$hub/hub-user.password" "$certs/hub-user.password"

# The simulated clusters' CA and their certificates.
if [ ! -f "$sim/ca/hub.yaml" ]; then
  tetherctl init --dir "$sim/ca" --hub-host sim-ca >/dev/null
  echo "init: simulated clusters' CA created"
fi
cp "$sim/ca/ca.crt" "$certs/sim-ca.crt"
for c in edge-1 edge-2; do
  mkdir -p "$sim/$c"
  tetherctl cert issue --dir "$sim/ca" --identity "broker:apiserver-$c" \
    --san kubernetes.default.svc --out "$sim/$c" --name apiserver --if-valid
done
# edge-2's squid: an HTTPS proxy (group-readable key: squid runs as proxy with group 65532).
tetherctl cert issue --dir "$sim/ca" --identity broker:squid-edge-2 --san squid \
  --san squid-edge-2 --out "$sim/edge-2" --name proxy --key-mode 0640 --if-valid
if [ ! -f "$sim/edge-2/proxy.password" ]; then
  head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$sim/edge-2/proxy.password"
  chmod 0600 "$sim/edge-2/proxy.password"
fi
# squid's basic_ncsa_auth reads MD5-crypt hashes; perl-base is part of every Debian system.
PW=$(cat "$sim/edge-2/proxy.password") perl -e \
  'my @c = ("a".."z", 0..9); my $s = join "", map { $c[rand @c] } 1..8;
   print "tether:", crypt($ENV{PW}, "\$1\$$s\$"), "\n"' >"$sim/edge-2/proxy.htpasswd"
chmod 0640 "$sim/edge-2/proxy.htpasswd"

# Bootstrap kubeconfigs: hub NATS through each cluster's proxy (written once: the token is
# single-use per cluster name only in the sense of its TTL; a registered cluster keeps its
# hub credentials in its state volume).
token=$(cat "$hub/bootstrap.token")
if [ ! -f "$sim/edge-1/bootstrap.kubeconfig" ]; then
  tetherctl join --hub-server tls://nats:4222 --hub-ca "$hub/ca.crt" --token "$token" \
    --proxy-url http://squid:3128 --out "$sim/edge-1/bootstrap.kubeconfig"
fi
if [ ! -f "$sim/edge-2/bootstrap.kubeconfig" ]; then
  tetherctl join --hub-server tls://nats:4222 --hub-ca "$hub/ca.crt" --token "$token" \
    --proxy-url "https://tether:$(cat "$sim/edge-2/proxy.password")@squid:3129" \
    --proxy-ca-file "$sim/ca/ca.crt" --out "$sim/edge-2/bootstrap.kubeconfig"
fi
echo "init: done"
