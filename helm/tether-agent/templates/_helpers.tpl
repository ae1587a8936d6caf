{{- define "tether-agent.name" -}}{{ .Release.Name }}-registration-agent{{- end -}}
{{- define "tether-agent.labels" -}}
app.kubernetes.io/part-of: tether
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
