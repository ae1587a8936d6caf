#!/usr/bin/env python3
"""Writes the seed corpora of fuzz/corpus/<target>/ from the repo's test fixtures and examples.

Run from the repo root: python3 fuzz/seed.py. Seeds are named seed-*, so files the fuzzer adds
(named by their SHA-1) can be minimised and committed next to them (docs/fuzzing.md).
"""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, value):
    """Protobuf field: int -> varint, bytes/str -> length-delimited."""
    if isinstance(value, int):
        return varint(num << 3) + varint(value)
    if isinstance(value, str):
        value = value.encode()
    return varint(num << 3 | 2) + varint(len(value)) + value


# CONNECT heads (tests/src/lib.rs connect(), connect.rs unit tests, docs/tunnel-protocol.md)
heads = {
    "apiserver": "CONNECT c1:443 HTTP/1.1\r\nhost: c1:443\r\nproxy-authorization: Bearer fuzz-token\r\n\r\n",
    "qualified": "CONNECT 10.0.0.1.c1.tether:8080 HTTP/1.1\r\nhost: 10.0.0.1.c1.tether:8080\r\nproxy-authorization: Bearer fuzz-token\r\n\r\nbytes after the head",
    "basic": "CONNECT svc.ns.svc.c2.tether:80 HTTP/1.1\r\nProxy-Authorization: Basic dXNlcjpmdXp6LXRva2Vu\r\n\r\n",
    "no-auth": "CONNECT c1:443 HTTP/1.0\r\n\r\n",
    "bare": "CONNECT\r\n\r\n",
    "no-version": "CONNECT c1:443\r\n\r\n",
    "http2": "CONNECT c1:443 HTTP/2.0\r\n\r\n",
    "bad-header": "CONNECT c1:443 HTTP/1.1\r\nbad header\r\n\r\n",
    "get": "GET / HTTP/1.1\r\nhost: x\r\n\r\n",
    "tls": bytes([0x16, 3, 1, 0, 5, 1, 2, 3, 4, 5]),
    "ipv6": "CONNECT [::1].c1.tether:443 HTTP/1.1\r\n\r\n",
    "partial": "CONNECT c1:443 HTTP/1.1\r\nhost: c1",
}
for k, v in heads.items():
    write("connect_head", k, v)

for k, v in {
    "bearer": "Bearer fuzz-token",
    "bearer-lower": "bearer   fuzz-token  ",
    "basic": "Basic dXNlcjpmdXp6LXRva2Vu",
    "basic-no-colon": "Basic Zm9v",
    "basic-bad": "Basic !!!",
    "digest": "Digest username=x",
    "empty": "",
}.items():
    write("proxy_credentials", k, v)

# konnectivity packets (tests/tests/grpc_support/mod.rs builders)
def packet(ptype, num, body):
    return field(1, ptype) + field(num, body) if ptype else field(num, body)

kp = {
    "dial-req": packet(0, 2, field(1, "tcp") + field(2, "10.0.0.1.c1.tether:80") + field(3, 42)),
    "dial-req-apiserver": packet(0, 2, field(1, "tcp") + field(2, "c1:443") + field(3, 7)),
    "dial-req-udp": packet(0, 2, field(1, "udp") + field(2, "c1:443") + field(3, 1)),
    "dial-rsp": packet(1, 3, field(2, 5) + field(3, 42)),
    "close-req": packet(2, 5, field(1, 5)),
    "close-rsp": packet(3, 6, field(1, "boom") + field(2, 5)),
    "data": packet(4, 4, field(1, 5) + field(3, b"hello world")),
    "dial-cls": packet(5, 7, field(1, 42)),
    "drain": packet(6, 8, b""),
    "negative-id": packet(4, 4, field(1, -1) + field(3, b"x")),
}
for k, v in kp.items():
    write("konnectivity_packet", k, v)

df = {
    "dial": field(1, field(1, "c1") + field(2, "10.0.0.1") + field(3, 8080) + field(4, 5000)),
    "dial-apiserver": field(1, field(1, "c1")),
    "dial-big-port": field(1, field(1, "c1") + field(2, "h") + field(3, 70000)),
    "result": field(2, field(1, 1) + field(4, 9) + field(5, 1200)),
    "data": field(3, b"payload bytes"),
    "abort": field(4, field(1, "client dropped the stream")),
}
for k, v in df.items():
    write("dial_frame", k, v)


# tether-tunnel/2 byte streams (shared/tunnel/src/mux/frame.rs): kind, flags, stream u32, len u24
def mux_frame(kind, stream, payload=b"", flags=0):
    return bytes([kind, flags]) + stream.to_bytes(4, "big") + len(payload).to_bytes(3, "big") + payload


def mux_str(s):
    s = s.encode()
    return len(s).to_bytes(2, "big") + s


window = mux_frame(10, 0, (4 << 20).to_bytes(4, "big") + (1 << 30).to_bytes(4, "big") + (20000).to_bytes(4, "big"))
hello = mux_frame(1, 0, mux_str("c1") + mux_str("tunnel-agent") + mux_str("broker-a"))
open_ = mux_frame(4, 1, (3000).to_bytes(4, "big") + (42).to_bytes(8, "big") + mux_str("c1")
                  + mux_str("db.ns.svc:5432") + bytes([1]) + mux_str("traceparent")
                  + mux_str("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))
mux_seeds = {
    "session": window + hello + open_ + mux_frame(7, 1, b"GET / HTTP/1.1\r\n\r\n")
    + mux_frame(9, 1, (1 << 16).to_bytes(4, "big")) + mux_frame(11, 0, b"12345678")
    + mux_frame(7, 1, b"", flags=1),
    "reset-goaway": window + open_ + mux_frame(8, 1, bytes([0]) + mux_str("cancelled"))
    + mux_frame(13, 0, (1).to_bytes(4, "big") + mux_str("agent shutting down")),
    "answers": window + mux_frame(5, 1) + mux_frame(6, 3, mux_str("refused") + mux_str("dial db: refused"))
    + mux_frame(2, 0, mux_str("c1") + mux_str("tunnel-agent")) + mux_frame(12, 0, b"12345678"),
    "beyond-window": window + open_ + mux_frame(7, 1, b"x" * 70000),
    # tether-dial/1: a client's credential before its OPEN; a broker's OPEN_OK with the stream id
    "dial-client": window + mux_frame(15, 0, mux_str("Bearer s3cret")) + open_
    + mux_frame(5, 1, (9).to_bytes(8, "big") + (140).to_bytes(4, "big")),
}
for k, v in mux_seeds.items():
    write("mux_frames", k, v)

# tunnel_address: one input a line (address, then its forms and patterns)
for k, lines in {
    "apiserver": ["c1:443", "apiserver", "*:*"],
    "qualified": ["10.0.0.1.c1.tether:80", "10.0.0.1:80", "10.0.0.*:80"],
    "dns": ["kube-dns.kube-system.svc.prod-eu.tether:53", "kube-dns.kube-system.svc:53", "*.svc:*"],
    "ipv6": ["[::1].c1.tether:443", "[::1]:443", "prod-*"],
    "bad-port": ["c1:0", "host:99999", ":80"],
    "labels": ["no_tunnel", "timeout", "overloaded"],
    "ctl": ["c1:443\x00\r", "\x7f", "x"],
}.items():
    write("tunnel_address", k, "\n".join(lines))

KC = """apiVersion: v1
kind: Config
clusters:
- name: hub
  cluster:
    server: {server}
    certificate-authority-data: {ca}
    tls-server-name: hub.example
contexts:
- name: bootstrap
  context:
    cluster: hub
    user: bootstrap
current-context: bootstrap
users:
- name: bootstrap
  user:
    token: secret
"""
write("kubeconfig", "tls", KC.format(server="tls://hub:4222", ca="LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg=="))
write("kubeconfig", "nats", KC.format(server="nats://10.0.0.1:4222", ca="Zm9v"))
write("kubeconfig", "https", KC.format(server="https://[::1]:6443", ca="Zm9v"))
write("kubeconfig", "no-ca", "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: tls://hub:4222\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\nusers:\n- name: u\n  user:\n    token: t\n")
write("kubeconfig", "server-only", "tls://hub.example:4222")

# tetherctl apply input: the compose example plus policies
for p in glob.glob(os.path.join(ROOT, "compose", "config", "addons.yaml")):
    write("apply_documents", "cluster-proxy", open(p, "rb").read())
write("apply_documents", "policy", """apiVersion: proxy.tether.io/v1alpha1
kind: ClientAccessPolicy
metadata: {name: ops}
spec:
  clients: [ops]
  rules:
    - clusters: ['prod-*']
      targets: [apiserver, '*.svc:8080']
    - clusterSelector: {matchLabels: {env: dev}}
      targets: ['*:*']
""")
write("apply_documents", "json-list", '{"kind":"List","items":[{"apiVersion":"addon.open-cluster-management.io/v1alpha1","kind":"ManagedClusterAddOn","metadata":{"name":"cluster-proxy","namespace":"c1"},"spec":{}}]}')
write("apply_documents", "json-array", '[{"kind":"ClusterManagementAddOn","metadata":{"name":"x"}}]')
write("apply_documents", "empty-docs", "---\n---\n")

# service configs: first byte picks broker (0), agent (1), prober (2)
for i, p in enumerate(sorted(glob.glob(os.path.join(ROOT, "compose", "config", "broker-*.yaml")))):
    write("service_config", f"broker-{i}", b"\x00" + open(p, "rb").read())
for p in glob.glob(os.path.join(ROOT, "compose", "config", "health-prober.yaml")):
    write("service_config", "prober", b"\x02" + open(p, "rb").read())
write("service_config", "broker-min", b"\x00id: b1\ntls: {cert: c, key: k, ca: a}\nclients:\n  - name: ops\n    token_sha256: " + b"ab" * 32 + b"\n    allow:\n      - clusters: ['*']\n        targets: ['apiserver', '*:*']\n")
write("service_config", "agent-min", b"\x01cluster: c1\nagent: agent-0\ntls: {cert: c, key: k, ca: a}\nbrokers:\n  - addresses: ['127.0.0.1:8443']\n    server_name: tether-broker\napiserver: '127.0.0.1:6443'\nbackoff: {initial: 50ms, max: 1s, reset_after: 5s}\n")
write("service_config", "agent-proxy", b"\x01cluster: c1\nagent: a\ntls: {cert: c, key: k, ca: a}\nbrokers: [{addresses: ['b:1'], server_name: s}]\nproxy: {url: 'http://squid:3128'}\n")
write("service_config", "empty", b"\x02")

# NATS payloads: first byte picks the type (fuzz/src/lib.rs nats_payload)
nats = [
    '{"clusterName":"c1","agentName":"agent-0","csr":"-----BEGIN CERTIFICATE REQUEST-----\\n","clusterClaims":[{"name":"id.k8s.io","value":"x"}],"labels":{"env":"prod"}}',
    '{"csrName":"c1-abc"}',
    '{"agentName":"agent-0","leaseDurationSeconds":60,"clusterClaims":[],"agentTime":"2026-01-02T03:04:05Z"}',
    '{"holderIdentity":"agent-0","leaseDurationSeconds":60,"connectedBrokers":["b1"]}',
    '{"appliedConfigs":[{"group":"addon.open-cluster-management.io","resource":"addondeploymentconfigs","namespace":"default","name":"x"}]}',
    '{"agentName":"agent-0"}',
    '{"cluster":"c1","broker":"b1","ok":true,"rttMicros":1200,"checkedAt":"2026-01-02T03:04:05Z"}',
    '{"cluster":"c1"}',
    '{"name":"ci","ttlSeconds":3600}',
    '{"name":"ci"}',
    '{"clusterName":"c1"}',
]
for i, body in enumerate(nats):
    write("nats_payload", f"type-{i}", bytes([i]) + body.encode())
print("seeds written under", CORPUS)
