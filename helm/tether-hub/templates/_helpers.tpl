{{- /* Names, labels and the Pod Security "restricted" snippets every workload uses. */ -}}
{{- define "tether-hub.name" -}}{{ .Release.Name }}{{- end -}}
{{- define "tether-hub.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}
{{- define "tether-hub.labels" -}}
app.kubernetes.io/part-of: tether
app.kubernetes.io/name: tether-hub
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- /* Pod labels: what selectors match plus what the scrape job selects (part-of). */ -}}
{{- define "tether-hub.podLabels" -}}
app.kubernetes.io/part-of: tether
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}
{{- define "tether-hub.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}
{{- define "tether-hub.scrape" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ . | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- define "tether-hub.podSecurity" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsUser }}
fsGroup: {{ .Values.securityContext.runAsUser }}
seccompProfile: {type: RuntimeDefault}
{{- end -}}
{{- define "tether-hub.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities: {drop: [ALL]}
{{- end -}}
{{- define "tether-hub.env" -}}
{{- range $k, $v := .Values.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}
{{- define "tether-hub.natsUrl" -}}
{{- .Values.nats.url | default (printf "tls://%s-nats.%s.svc:4222" .Release.Name .Release.Namespace) -}}
{{- end -}}
{{- define "tether-hub.hubDirSecret" -}}{{ .Values.hubDirSecret | default (printf "%s-hub-dir" .Release.Name) }}{{- end -}}
{{- define "tether-hub.brokerTlsSecret" -}}{{ .Values.brokers.tlsSecret | default (printf "%s-broker-tls" .Release.Name) }}{{- end -}}
{{- define "tether-hub.proberSecret" -}}{{ .Values.healthProber.clientCertSecret | default (printf "%s-health-prober-client" .Release.Name) }}{{- end -}}
{{- define "tether-hub.natsTlsSecret" -}}{{ printf "%s-nats-tls" .Release.Name }}{{- end -}}
{{- define "tether-hub.natsAuthSecret" -}}{{ printf "%s-nats-auth" .Release.Name }}{{- end -}}
{{- define "tether-hub.brokerPod" -}}{{ printf "%s-broker-%d" (include "tether-hub.name" .root) .i }}{{- end -}}
{{- define "tether-hub.monitor" -}}
{{- /* ServiceMonitor / PodMonitor for one component (.kind, .component, .port). */ -}}
apiVersion: monitoring.coreos.com/v1
kind: {{ .kind }}
metadata:
  name: {{ .root.Release.Name }}-{{ .component }}
  labels: {{- include "tether-hub.labels" .root | nindent 4 }}
spec:
  selector:
    matchLabels: {{- include "tether-hub.selector" . | nindent 6 }}
  {{ if eq .kind "PodMonitor" }}podMetricsEndpoints{{ else }}endpoints{{ end }}:
    - port: admin
      path: /metrics
      interval: {{ .root.Values.monitoring.interval }}
{{- end -}}
