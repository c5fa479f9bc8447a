{{- define "slofleet.name" -}}{{ .Release.Name }}-operator{{- end -}}
{{- define "slofleet.routerRole" -}}{{ .Release.Name }}-router{{- end -}}
{{- define "slofleet.sa" -}}{{ default (include "slofleet.name" .) .Values.serviceAccount.name }}{{- end -}}
{{- define "slofleet.labels" -}}
app.kubernetes.io/name: slofleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: slofleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- define "slofleet.selector" -}}
app.kubernetes.io/name: slofleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "slofleet.autoscaler" -}}{{ .Release.Name }}-autoscaler{{- end -}}
{{- define "slofleet.autoscalerLabels" -}}
app.kubernetes.io/name: slofleet-autoscaler
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: slofleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
