{{/* Names, labels and validations shared by every template. */}}

{{- define "pdgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: fullname-component (router, prefill, decode). */}}
{{- define "pdgate.componentName" -}}
{{- printf "%s-%s" (include "pdgate.fullname" .ctx) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdgate.labels" -}}
{{ include "pdgate.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: pdgate
{{- end -}}

{{/* Label selector (string form) the router watches engine pods of one role with. */}}
{{- define "pdgate.engineSelector" -}}
{{- printf "app.kubernetes.io/name=%s,app.kubernetes.io/instance=%s,pdgate.io/role=%s" (include "pdgate.name" .ctx) .ctx.Release.Name .role -}}
{{- end -}}

{{- define "pdgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdgate.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "pdgate.enginePort" -}}
{{- if eq .Values.engines.kind "vllm" -}}
{{- .Values.engines.vllm.port -}}
{{- else -}}
{{- .Values.engines.shim.port -}}
{{- end -}}
{{- end -}}

{{- define "pdgate.servedModelName" -}}
{{- if .Values.servedModelName -}}
{{- first .Values.servedModelName -}}
{{- else -}}
{{- .Values.model -}}
{{- end -}}
{{- end -}}

{{- define "pdgate.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "pdgate.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "pdgate.notifySecret" -}}
{{- default (printf "%s-notify" (include "pdgate.fullname" .)) .Values.notificationSecret.existingSecret -}}
{{- end -}}

{{/* The router's YAML config: RouterConfig fields (router/config.py), nothing else. */}}
{{- define "pdgate.routerConfig" -}}
{{- $cfg := dict
  "model" .Values.model
  "host" "0.0.0.0"
  "port" .Values.router.port
  "discovery" "k8s"
  "namespace" .Release.Namespace
  "prefill_selector" (include "pdgate.engineSelector" (dict "ctx" . "role" "prefill"))
  "decode_selector" (include "pdgate.engineSelector" (dict "ctx" . "role" "decode"))
  "prefill_port" (include "pdgate.enginePort" . | int)
  "decode_port" (include "pdgate.enginePort" . | int)
  "prefill_policy" .Values.router.prefillPolicy
  "decode_policy" .Values.router.decodePolicy
  "log_level" .Values.router.logLevel
-}}
{{- if .Values.servedModelName -}}
{{- $_ := set $cfg "served_model_name" .Values.servedModelName -}}
{{- end -}}
{{- toYaml (merge (deepCopy .Values.router.config) $cfg) -}}
{{- end -}}

{{/* Fail early, with the values key in the message, on settings that cannot work. */}}
{{- define "pdgate.validate" -}}
{{- if not .Values.model -}}
{{- fail "model: set the model the engines serve (a path under /models or a hub name)" -}}
{{- end -}}
{{- if not (has .Values.engines.kind (list "shim" "vllm")) -}}
{{- fail (printf "engines.kind: must be shim or vllm, not %q" .Values.engines.kind) -}}
{{- end -}}
{{- if and (eq .Values.engines.kind "shim") (not (hasPrefix "/" .Values.model)) (ne .Values.model "tiny") -}}
{{- fail (printf "model: shim engines load a local directory (a path under /models, from modelVolume), not %q" .Values.model) -}}
{{- end -}}
{{- if and (hasPrefix "/models" .Values.model) (not .Values.modelVolume) -}}
{{- fail "modelVolume: model is a path under /models, so a volume must be mounted there" -}}
{{- end -}}
{{- if and (eq .Values.engines.kind "vllm") (not .Values.engines.vllm.image.repository) -}}
{{- fail "engines.vllm.image.repository: set the vLLM image to run" -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- if lt (int (index $.Values.engines $role).replicas) 1 -}}
{{- fail (printf "engines.%s.replicas: at least one %s engine is needed" $role $role) -}}
{{- end -}}
{{- end -}}
{{- with .Values.router.autoscaling -}}
{{- if and .enabled (gt (int .minReplicas) (int .maxReplicas)) -}}
{{- fail "router.autoscaling: minReplicas must not exceed maxReplicas" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.router.pdb.enabled (not .Values.router.autoscaling.enabled) (ge (int .Values.router.pdb.minAvailable) (int .Values.router.replicas)) -}}
{{- fail "router.pdb.minAvailable: must be below router.replicas, or no router pod could ever be evicted (drains would hang)" -}}
{{- end -}}
{{- if and .Values.router.ingress.enabled (not .Values.router.ingress.host) -}}
{{- fail "router.ingress.host: set the host name the ingress serves" -}}
{{- end -}}
{{- if and .Values.router.serviceMonitor.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
{{- fail "router.serviceMonitor.enabled: the cluster has no monitoring.coreos.com/v1 API (install the Prometheus operator first)" -}}
{{- end -}}
{{- if and .Values.engines.podMonitor.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
{{- fail "engines.podMonitor.enabled: the cluster has no monitoring.coreos.com/v1 API (install the Prometheus operator first)" -}}
{{- end -}}
{{- if and .Values.notificationSecret.value (lt (len .Values.notificationSecret.value) 16) -}}
{{- fail "notificationSecret.value: use at least 16 characters" -}}
{{- end -}}
{{- end -}}
