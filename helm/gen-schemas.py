#!/usr/bin/env python3
"""Writes every chart's values.schema.json (run from helm/: `python3 gen-schemas.py`).

One place for the shared rules (DNS-1123 names, ports, durations, resources) so the four
schemas agree; unknown keys are rejected (additionalProperties: false). After a change, run
`helm dependency build tether` too (the umbrella's subchart archives carry the schemas).
"""
import json
LABEL={"type":"string","pattern":"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$","maxLength":63}
SUB={"type":"string","pattern":"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$","maxLength":253}
SUBOPT={"type":"string","pattern":"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$","maxLength":253}
DUR={"type":"string","pattern":"^([0-9]+(\\.[0-9]+)?(ms|s|m|h|d))+$"}
PORT={"type":"integer","minimum":1,"maximum":65535}
BOOL={"type":"boolean"}
def obj(props, req=None, extra=False):
    o={"type":"object","properties":props,"additionalProperties":extra}
    if req: o["required"]=req
    return o
def d(desc, s): s=dict(s); s["description"]=desc; return s
RES={"type":"object","description":"container resources (requests/limits)","properties":{"requests":{"type":"object"},"limits":{"type":"object"}},"additionalProperties":False}
IMAGE=obj({"repository":{"type":"string","minLength":1},"tag":{"type":"string","minLength":1},"pullPolicy":{"enum":["Always","IfNotPresent","Never"]}},["repository","tag"])
SEC=obj({"runAsUser":{"type":"integer","minimum":1}})
ENV={"type":"object","additionalProperties":{"type":["string","number","boolean"]},"propertyNames":{"pattern":"^[A-Za-z_][A-Za-z0-9_]*$"}}
ENABLED={"type":"object","properties":{"enabled":BOOL}}
hub=obj({
 "enabled":BOOL,"global":{"type":"object"},
 "image":IMAGE,"securityContext":SEC,
 "nats":obj({"url":{"type":"string","pattern":"^$|^(tls|nats)://[^\\s]+:[0-9]+$"},"serverName":SUB}),
 "hubDirSecret":SUBOPT,
 "bootstrap":obj({"enabled":BOOL,"writeSecrets":BOOL,"natsReplicas":{"type":"integer","minimum":1,"maximum":15},
   "hubHosts":{"type":"array","items":SUB},"autoAccept":{"type":"array","items":{"type":"string","pattern":"^[a-z0-9*?\\-]+$"}},
   "certLifetime":DUR,"resources":RES}),
 "env":ENV,
 "brokers":obj({"replicas":d("broker pods (each one a broker id)",{"type":"integer","minimum":1,"maximum":64}),
   "advertiseDomain":SUB,"agentPort":PORT,"clientPort":PORT,"clientTlsPort":PORT,"adminPort":PORT,
   "tlsSecret":SUBOPT,"dialTimeout":DUR,"drainGrace":DUR,"terminationGracePeriodSeconds":{"type":"integer","minimum":1},
   "maxPendingDialsPerTunnel":{"type":"integer","minimum":1},"enforceClusters":BOOL,"discoverPeers":BOOL,
   "clients":{"type":"array","items":obj({"name":LABEL},["name"],True)},
   "agentServiceType":{"enum":["ClusterIP","NodePort","LoadBalancer"]},"clientServiceType":{"enum":["ClusterIP","NodePort","LoadBalancer"]},
   "topologySpreadConstraints":{"type":"array"},"resources":RES},["replicas"]),
 "addonManager":obj({"enabled":BOOL,"replicas":{"type":"integer","minimum":0},"adminPort":PORT,"resources":RES}),
 "healthProber":obj({"enabled":BOOL,"interval":DUR,"timeout":DUR,"concurrency":{"type":"integer","minimum":1},
   "failureThreshold":{"type":"integer","minimum":1},"successThreshold":{"type":"integer","minimum":1},"adminPort":PORT,
   "clientCertSecret":SUBOPT,"apiserverCaSecret":SUBOPT,"resources":RES}),
 "monitoring":obj({"serviceMonitor":BOOL,"podMonitor":BOOL,"interval":DUR}),
})
hub["$schema"]="http://json-schema.org/draft-07/schema#"; hub["title"]="tether-hub values"
agent=obj({
 "enabled":BOOL,"global":{"type":"object"},
 "image":IMAGE,"securityContext":SEC,
 "clusterName":d("this cluster's name on the hub (DNS-1123 label)",LABEL),
 "labels":{"type":"object","additionalProperties":{"type":"string"}},
 "claims":{"type":"object","additionalProperties":{"type":"string"}},
 "bootstrap":obj({"secretName":SUB,"secretKey":{"type":"string","pattern":"^[-._a-zA-Z0-9]+$"}}),
 "proxy":obj({"httpProxy":{"type":"string"},"httpsProxy":{"type":"string"},"noProxy":{"type":"string"}}),
 "secretStore":{"enum":["kube","file"]},"addonRuntime":{"enum":["kube","local"]},
 "hubKubeconfigSecret":SUB,
 "addon":obj({"name":LABEL,"installNamespace":LABEL,"createInstallNamespace":BOOL,"image":{"type":"string","minLength":1},
   "apiserver":{"type":"string","pattern":"^[^\\s:]+:[0-9]+$"},"leaseSeconds":{"type":"integer","minimum":1},"resync":DUR}),
 "adminPort":PORT,"env":ENV,"resources":RES,
 "monitoring":obj({"podMonitor":BOOL,"interval":DUR}),
},["clusterName"])
agent["$schema"]=hub["$schema"]; agent["title"]="tether-agent values"
nats=obj({
 "enabled":BOOL,"global":{"type":"object"},
 "image":IMAGE,"securityContext":SEC,
 "cluster":obj({"name":d("NATS cluster name",LABEL),"replicas":{"type":"integer","minimum":1,"maximum":15},"routePort":PORT}),
 "clientPort":PORT,"monitorPort":PORT,
 "tlsSecret":SUBOPT,"authSecret":SUBOPT,
 "jetstream":obj({"maxMemory":{"type":"string","pattern":"^[0-9]+[KMGT]?$"},"maxFile":{"type":"string","pattern":"^[0-9]+[KMGT]?$"},
   "persistence":obj({"enabled":BOOL,"size":{"type":"string","pattern":"^[0-9]+(Ki|Mi|Gi|Ti)$"},"storageClassName":{"type":"string"}})}),
 "topologySpreadConstraints":{"type":"array"},"resources":RES,
})
nats["$schema"]=hub["$schema"]; nats["title"]="tether-nats values"
umb=obj({
 "global":{"type":"object"},
 "tether-hub":{"type":"object"},"tether-agent":{"type":"object"},"tether-nats":{"type":"object"},
})
umb["$schema"]=hub["$schema"]; umb["title"]="tether values (each subchart's own schema checks its section)"
for path,s in [("tether-hub",hub),("tether-agent",agent),("tether-nats",nats),("tether",umb)]:
    import os; os.makedirs(path,exist_ok=True)
    open(f"{path}/values.schema.json","w").write(json.dumps(s,indent=2)+"\n")
