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
{{- define "slofleet.image" -}}{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}{{- end -}}
{{- define "slofleet.autoscaler" -}}{{ .Release.Name }}-autoscaler{{- end -}}
{{- define "slofleet.autoscalerLabels" -}}
app.kubernetes.io/name: slofleet-autoscaler
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: slofleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- /* The engines' histogram bounds, as /metrics writes them in `le` (engine/server/metrics.py; a test keeps
them equal): LATENCY_BUCKETS for TTFT and E2E, TOKEN_BUCKETS for the time per output token. */ -}}
{{- define "slofleet.latencyBounds" -}}0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0 160.0{{- end -}}
{{- define "slofleet.tokenBounds" -}}0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0{{- end -}}
{{- /* The bound a target of `ms` milliseconds is read at: the nearest one (the lower on a tie). */ -}}
{{- define "slofleet.le" -}}
{{- $le := first .bounds -}}
{{- $best := -1.0 -}}
{{- range .bounds }}{{ $d := subf (round (mulf (float64 .) 1000.0) 3) (float64 $.ms) }}{{ if lt $d 0.0 }}{{ $d = mulf $d -1.0 }}{{ end }}
{{- if or (lt $best 0.0) (lt $d $best) }}{{ $le = . }}{{ $best = $d }}{{ end }}{{ end -}}
{{- $le -}}
{{- end -}}
{{- define "slofleet.monitoringLabels" -}}
app.kubernetes.io/name: slofleet-monitoring
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: slofleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- /* An exec probe that passes when a TCP connection to the API server (the pod's KUBERNETES_SERVICE_* address)
opens within 3 s. manifests/autoscaler.yaml carries the same command. */ -}}
{{- define "slofleet.apiServerProbe" -}}
[python, -c, "import os, socket; socket.create_connection((os.environ['KUBERNETES_SERVICE_HOST'], int(os.environ['KUBERNETES_SERVICE_PORT'])), 3).close()"]
{{- end -}}

{{- /* Egress that both control-plane Deployments need: the API server, DNS, and every LLMService's pods (any
namespace; each service picks its own ports, so none is named). */ -}}
{{- define "slofleet.controlEgress" -}}
{{- $np := .Values.networkPolicy -}}
- ports:
  {{- range $np.apiServerPorts }}
    - {protocol: TCP, port: {{ . }}}
  {{- end }}
  {{- with $np.apiServerCidrs }}
  to:
    {{- range . }}
    - ipBlock: {cidr: {{ . }}}
    {{- end }}
  {{- end }}
- ports:
    - {protocol: UDP, port: 53}
    - {protocol: TCP, port: 53}
- to:
    - namespaceSelector: {}
      podSelector:
        matchExpressions: [{key: slofleet.dev/service, operator: Exists}]
{{- end -}}
