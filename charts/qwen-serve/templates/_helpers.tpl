{{/* Names are truncated to 63 characters, the DNS label limit. */}}
{{- define "qwen-serve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "qwen-serve.operatorName" -}}
{{- printf "%s-operator" (include "qwen-serve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qwen-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "qwen-serve.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "qwen-serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces the operator watches: the listed ones, else the release namespace. */}}
{{- define "qwen-serve.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- join "," .Values.operator.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "qwen-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: qwen-serve
{{- end -}}

{{- define "qwen-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Container hardening shared by every pod of the chart. */}}
{{- define "qwen-serve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* RBAC rules: exactly what the operator calls; no delete (owner references cascade), no reading secrets. */}}
{{- define "qwen-serve.rules" }}
rules:
  - apiGroups: ["qwenserve.io"]
    resources: ["qwendeployments"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["qwenserve.io"]
    resources: ["qwendeployments/status"]
    verbs: ["get", "patch"]
  - apiGroups: ["apps"]
    resources: ["deployments"]
    verbs: ["get", "list", "watch", "create", "patch"]
  - apiGroups: [""]
    resources: ["services", "configmaps"]
    verbs: ["get", "list", "watch", "create", "patch"]
  # One stage-credential Secret per QwenDeployment, created once; the operator never reads or lists Secrets.
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["create"]
  # One NetworkPolicy per stage; like every child it goes with its QwenDeployment (owner references).
  - apiGroups: ["networking.k8s.io"]
    resources: ["networkpolicies"]
    verbs: ["get", "create", "patch"]
  # The autoscaler reads pod IPs to scrape each pod's /metrics.
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["get", "list"]
  - apiGroups: ["", "events.k8s.io"]
    resources: ["events"]
    verbs: ["create"]
{{- end }}
