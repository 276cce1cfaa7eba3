{{/* Chart name, truncated to a DNS label. */}}
{{- define "lorarl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name; leaves room for the longest suffix ("-operator-metrics"). */}}
{{- define "lorarl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of a cluster-scoped object: carries the namespace so that releases of the same name in
two namespaces (singleNamespace mode) never fight over one ClusterRole or webhook configuration.
*/}}
{{- define "lorarl.clusterName" -}}
{{- printf "%s-%s" (include "lorarl.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "lorarl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "lorarl.labels" -}}
helm.sh/chart: {{ include "lorarl.chart" . }}
app.kubernetes.io/name: {{ include "lorarl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lorarl
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "lorarl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lorarl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects. */}}
{{- define "lorarl.componentLabels" -}}
{{ include "lorarl.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* An image reference; call with (dict "ctx" $ "image" .Values.operator.image). */}}
{{- define "lorarl.image" -}}
{{- $repo := printf "%s/%s" .ctx.Values.image.registry .image.repository }}
{{- if .image.digest }}
{{- printf "%s@%s" $repo .image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion .ctx.Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "lorarl.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "lorarl.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lorarl.statusApiServiceAccount" -}}
{{- if .Values.statusApi.serviceAccount.create }}
{{- default (printf "%s-status-api" (include "lorarl.fullname" .)) .Values.statusApi.serviceAccount.name }}
{{- else }}
{{- required "statusApi.serviceAccount.name is required when statusApi.serviceAccount.create is false" .Values.statusApi.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Namespace the operator and status API watch: "" means all namespaces. */}}
{{- define "lorarl.watchNamespace" -}}
{{- if .Values.singleNamespace }}{{ .Release.Namespace }}{{ end }}
{{- end }}

{{- define "lorarl.webhookServiceName" -}}
{{- printf "%s-webhook" (include "lorarl.fullname" .) }}
{{- end }}

{{- define "lorarl.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "lorarl.fullname" .) }}
{{- end }}

{{- define "lorarl.webhookCertName" -}}
{{- printf "%s-webhook" (include "lorarl.fullname" .) }}
{{- end }}

{{- define "lorarl.statusApiName" -}}
{{- printf "%s-status-api" (include "lorarl.fullname" .) }}
{{- end }}
