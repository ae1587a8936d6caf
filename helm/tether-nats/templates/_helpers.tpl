{{- define "tether-nats.name" -}}{{ .Release.Name }}-nats{{- end -}}
{{- define "tether-nats.labels" -}}
app.kubernetes.io/part-of: tether
app.kubernetes.io/name: tether-nats
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- define "tether-nats.selector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: nats
{{- end -}}
{{- define "tether-nats.tlsSecret" -}}{{ .Values.tlsSecret | default (printf "%s-nats-tls" .Release.Name) }}{{- end -}}
{{- define "tether-nats.authSecret" -}}{{ .Values.authSecret | default (printf "%s-nats-auth" .Release.Name) }}{{- end -}}
