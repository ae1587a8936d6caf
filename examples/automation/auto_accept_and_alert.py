#!/usr/bin/env python3
"""Tether automation using nothing but NATS (docs/nats-api.md).

Two jobs, side by side:

1. Auto-accept: watch the `tether-managedclusters` KV bucket; every cluster that is not yet
   accepted (spec.hubAcceptsClient false) and whose cluster claims and labels match the rule
   (every --claim NAME=VALUE and every --label KEY=VALUE; `*` in a value matches any run of
   characters) is accepted with a request on `tether.v1.admin.accept`.
2. Alerting: an ephemeral JetStream consumer on `tether.v1.events.health.>` (stream
   TETHER_EVENTS, new events only); a `ClusterProbeFailed` event prints
   `ALERT cluster <c> probe failed: <message>`, a `ClusterProbeSucceeded` prints `RESOLVED ...`.

Credentials: the hub's admin NATS user (`<hub dir>/admin-user.password`), TLS verified against
`<hub dir>/ca.crt` and the hub's NATS server name (`nats.serverName` in `<hub dir>/hub.yaml`).

    pip install nats-py==2.16.0   # scripts/install-deps.sh does it
    python3 auto_accept_and_alert.py --hub-dir hub --nats-url tls://127.0.0.1:4222 \
        --claim platform=k3s --label env=dev

Output lines are flushed at once (one line per decision), so a supervisor or a test can follow.
"""

import argparse
import asyncio
import fnmatch
import json
import os
import re
import signal
import ssl
import sys

import nats
from nats.js.api import ConsumerConfig, DeliverPolicy

ACCEPT = "tether.v1.admin.accept"
HEALTH_EVENTS = "tether.v1.events.health.>"
CLUSTERS_BUCKET = "tether-managedclusters"
REQUEST_TIMEOUT_S = 5.0


def log(*args):
    print(*args, flush=True)


def parse_pairs(items, flag):
    out = {}
    for item in items or []:
        if "=" not in item:
            sys.exit(f"{flag} {item!r}: expected NAME=VALUE")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def matches(rule_claims, rule_labels, mc):
    """True when every claim and label of the rule is present with a matching value."""
    if not rule_claims and not rule_labels:
        return False  # an empty rule accepts nothing
    claims = {c.get("name"): c.get("value", "") for c in mc.get("status", {}).get("clusterClaims", [])}
    labels = mc.get("metadata", {}).get("labels", {}) or {}
    for k, pattern in rule_claims.items():
        if k not in claims or not fnmatch.fnmatchcase(claims[k], pattern):
            return False
    for k, pattern in rule_labels.items():
        if k not in labels or not fnmatch.fnmatchcase(labels[k], pattern):
            return False
    return True


def hub_server_name(hub_dir):
    text = open(os.path.join(hub_dir, "hub.yaml")).read()
    m = re.search(r"serverName:\s*['\"]?([^'\"\s]+)", text)
    if not m:
        sys.exit(f"{hub_dir}/hub.yaml: no nats.serverName")
    return m.group(1)


async def auto_accept(nc, js, rule_claims, rule_labels):
    kv = await js.key_value(CLUSTERS_BUCKET)
    watcher = await kv.watchall()
    accepted = set()
    async for entry in watcher:
        if entry is None:  # end of the current values; changes follow
            log("auto-accept: watching for new clusters")
            continue
        if entry.operation is not None or not entry.value:  # deleted or purged
            accepted.discard(entry.key)
            continue
        mc = json.loads(entry.value)
        name = mc["metadata"]["name"]
        if mc.get("spec", {}).get("hubAcceptsClient") or name in accepted:
            continue
        if not matches(rule_claims, rule_labels, mc):
            log(f"auto-accept: {name} does not match the rule; left pending")
            continue
        accepted.add(name)
        body = json.dumps({"clusterName": name}).encode()
        try:
            msg = await nc.request(ACCEPT, body, timeout=REQUEST_TIMEOUT_S)
        except Exception as e:  # timeout, no responders
            accepted.discard(name)
            log(f"auto-accept: {name}: request failed: {e}")
            continue
        err = (msg.headers or {}).get("Tether-Error")
        if err:
            accepted.discard(name)
            log(f"auto-accept: {name}: hub refused: {err}")
        else:
            log(f"ACCEPTED cluster {name} (claims and labels match the rule)")


async def alerts(js):
    sub = await js.subscribe(
        HEALTH_EVENTS,
        stream="TETHER_EVENTS",
        config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
    )
    log("alerts: watching health events")
    async for msg in sub.messages:
        try:
            ev = json.loads(msg.data)
        except ValueError:
            await msg.ack()
            continue
        cluster = ev.get("involvedObject", {}).get("name", "?")
        if ev.get("reason") == "ClusterProbeFailed":
            log(f"ALERT cluster {cluster} probe failed: {ev.get('message', '')}")
        elif ev.get("reason") == "ClusterProbeSucceeded":
            log(f"RESOLVED cluster {cluster}: {ev.get('message', '')}")
        await msg.ack()


async def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hub-dir", default=os.environ.get("TETHER_HUB_DIR", "hub"))
    p.add_argument("--nats-url", default=os.environ.get("TETHER_NATS_URL"), required=False)
    p.add_argument("--server-name", help="name in the NATS server certificate (default: from hub.yaml)")
    p.add_argument("--claim", action="append", help="NAME=VALUE a cluster claim must match (repeatable)")
    p.add_argument("--label", action="append", help="KEY=VALUE a label must match (repeatable)")
    a = p.parse_args()
    if not a.nats_url:
        sys.exit("--nats-url (or TETHER_NATS_URL) is required, e.g. tls://127.0.0.1:4222")
    rule_claims = parse_pairs(a.claim, "--claim")
    rule_labels = parse_pairs(a.label, "--label")

    tls = ssl.create_default_context(cafile=os.path.join(a.hub_dir, "ca.crt"))
    password = open(os.path.join(a.hub_dir, "admin-user.password")).read().strip()
    nc = await nats.connect(
        servers=[a.nats_url],
        tls=tls,
        tls_hostname=a.server_name or hub_server_name(a.hub_dir),
        user="tether-admin",
        password=password,
        name="tether/automation-example",
        connect_timeout=5,
        max_reconnect_attempts=-1,
    )
    js = nc.jetstream()
    log(f"connected to {a.nats_url}; rule: claims={rule_claims} labels={rule_labels}")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, stop.set)
    tasks = [
        asyncio.create_task(auto_accept(nc, js, rule_claims, rule_labels)),
        asyncio.create_task(alerts(js)),
    ]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait(tasks + [stopper], return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        if t in done and t.exception():
            log(f"error: {t.exception()!r}")
        t.cancel()
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main())
