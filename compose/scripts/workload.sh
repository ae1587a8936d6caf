#!/bin/sh
# `workload-edge-N`: what runs inside a simulated managed cluster, reachable only on its
# internal network:
#   web.default.svc:8080             a web service (busybox httpd) answering "hello from <cluster>"
#   kubernetes.default.svc:6443      an API-server stand-in: TLS (certificate from the simulated
#                                    clusters' CA, SAN kubernetes.default.svc) in front of the same
#                                    httpd, whose /livez answers 200 for the health-prober
set -eu
cluster=$1
www=/tmp/www
mkdir -p "$www"
echo "hello from $cluster" >"$www/index.html"
echo ok >"$www/livez"
echo ok >"$www/healthz"
busybox httpd -f -p 0.0.0.0:8080 -h "$www" &
exec socat -d "OPENSSL-LISTEN:6443,reuseaddr,fork,verify=0,cert=/etc/tether/sim/$cluster/apiserver.crt,key=/etc/tether/sim/$cluster/apiserver.key" TCP:127.0.0.1:8080
