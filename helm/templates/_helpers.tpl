{{/* Names, labels and the server's command line, shared by every template. */}}

{{- define "minisgl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "minisgl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "minisgl.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "minisgl.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "minisgl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "minisgl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "minisgl.labels" -}}
{{ include "minisgl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Does this release serve a model itself (a Deployment and a Service)? */}}
{{- define "minisgl.direct" -}}
{{- if or .Values.model .Values.demo }}true{{ end }}
{{- end }}

{{- define "minisgl.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "-cpu" "" (eq .Values.device "cpu"))) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* Where the model is read from inside the pod: the value of --model. */}}
{{- define "minisgl.modelPath" -}}
{{- $m := .Values.model }}
{{- if hasPrefix "pvc://" $m }}
{{- $rest := trimPrefix "pvc://" $m }}
{{- printf "/models/%s" (regexReplaceAll "^[^/]*/?" $rest "") | trimSuffix "/" }}
{{- else if .Values.revision }}
{{- printf "/home/minisgl/.cache/minisgl-models/%s/%s" (trimPrefix "hf://" $m) .Values.revision }}
{{- else }}
{{- trimPrefix "hf://" $m }}
{{- end }}
{{- end }}

{{- define "minisgl.pvcClaim" -}}
{{- if hasPrefix "pvc://" .Values.model }}{{ regexFind "^[^/]+" (trimPrefix "pvc://" .Values.model) }}{{ end }}
{{- end }}

{{/* The name clients use: servedModelName, else the model id (or the path inside the claim). */}}
{{- define "minisgl.servedName" -}}
{{- if .Values.servedModelName }}{{ .Values.servedModelName }}
{{- else if .Values.demo }}demo
{{- else if hasPrefix "pvc://" .Values.model }}{{ regexReplaceAll "^[^/]*/?" (trimPrefix "pvc://" .Values.model) "" | trimSuffix "/" }}
{{- else }}{{ trimPrefix "hf://" .Values.model }}
{{- end }}
{{- end }}

{{/* The server's arguments (the image's entrypoint is `python -m minisgl`). */}}
{{- define "minisgl.args" -}}
{{- if .Values.demo -}}
- --demo
{{- else -}}
- --model
- {{ include "minisgl.modelPath" . | quote }}
{{- end }}
- --served-model-name
- {{ include "minisgl.servedName" . | quote }}
- --device
- {{ .Values.device }}
- --tp
- {{ .Values.tp | quote }}
- --host
- 0.0.0.0
- --port
- {{ .Values.port | quote }}
- --shutdown-timeout
- {{ .Values.drainTimeoutSeconds | quote }}
{{- if .Values.apiKeySecret.name }}
- --api-key
- $(MINISGL_API_KEY)
{{- end }}
{{- range .Values.args }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{- define "minisgl.strategy" -}}
{{- $type := .Values.strategy | default (ternary "Recreate" "RollingUpdate" (eq .Values.device "cuda")) -}}
type: {{ $type }}
{{- if eq $type "RollingUpdate" }}
rollingUpdate:
  maxSurge: 1
  maxUnavailable: 0
{{- end }}
{{- end }}

{{/* In-cluster base URL of the OpenAI API. */}}
{{- define "minisgl.url" -}}
http://{{ include "minisgl.fullname" . }}.{{ .Release.Namespace }}.svc:{{ .Values.service.port }}/v1
{{- end }}

{{/* The restricted Pod Security Standard, for every container. */}}
{{- define "minisgl.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* A JSON schema made structural for a CRD: `additionalProperties: false` dropped (the API server prunes
  unknown fields instead), everything else kept. Takes a schema dict, returns JSON. */}}
{{- define "minisgl.structural" -}}
{{- $out := dict }}
{{- range $key, $value := . }}
{{- if eq $key "properties" }}
{{- $props := dict }}
{{- range $name, $sub := $value }}
{{- $_ := set $props $name (include "minisgl.structural" $sub | fromJson) }}
{{- end }}
{{- $_ := set $out "properties" $props }}
{{- else if and (eq $key "items") (kindIs "map" $value) }}
{{- $_ := set $out "items" (include "minisgl.structural" $value | fromJson) }}
{{- else if not (and (eq $key "additionalProperties") (kindIs "bool" $value)) }}
{{- $_ := set $out $key $value }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}
