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

{{/* Does the router check client keys? Keys given, an existing Secret, or (neither, and
anonymous access not allowed) a generated key. */}}
{{- define "pdgate.clientKeys" -}}
{{- if or .Values.apiKeys.keys .Values.apiKeys.existingSecret (not .Values.auth.allowAnonymous) -}}true{{- end -}}
{{- end -}}

{{/* Every model the release serves, as {plans: [...]}: `models` when set, else the one
model of `model` / `servedModelName` / `engines.*` / `router.pdMode`. A plan: name ("" for
the one model: its objects keep their names), model, served (names), pdMode, prefix (of its
components), pools (role -> engine pool values; a colocated model has no prefill pool),
routerConfig (RouterConfig fields of its `models:` entry). */}}
{{- define "pdgate.modelPlans" -}}
{{- $plans := list -}}
{{- if .Values.models -}}
{{- range $m := .Values.models -}}
{{- $mode := default $.Values.router.pdMode $m.pdMode -}}
{{- $pools := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- if or (eq $role "decode") (ne $mode "colocated") -}}
{{- $_ := set $pools $role (merge (deepCopy (default dict (index $m $role))) (deepCopy (index $.Values.engines $role))) -}}
{{- end -}}
{{- end -}}
{{- $plans = append $plans (dict "name" $m.name "model" $m.model "served" (default (list $m.name) $m.servedModelName) "pdMode" $mode "prefix" (printf "%s-" $m.name) "pools" $pools "routerConfig" (default dict $m.routerConfig)) -}}
{{- end -}}
{{- else -}}
{{- $plans = append $plans (dict "name" "" "model" .Values.model "served" (default (list .Values.model) .Values.servedModelName) "pdMode" .Values.router.pdMode "prefix" "" "pools" (dict "prefill" .Values.engines.prefill "decode" .Values.engines.decode) "routerConfig" dict) -}}
{{- end -}}
{{- toYaml (dict "plans" $plans) -}}
{{- end -}}

{{/* vLLM's KV connector for the mode: pull reads (NixlConnector), push writes
(NixlPushConnector). */}}
{{- define "pdgate.vllmConnector" -}}
{{- if eq .Values.router.pdMode "push" -}}NixlPushConnector{{- else -}}NixlConnector{{- end -}}
{{- end -}}

{{/* OTEL_* env of a pdgate or vLLM container when tracing is on (indent with nindent). */}}
{{- define "pdgate.tracingEnv" -}}
{{- with .Values.tracing -}}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
  value: {{ .protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
{{- if .samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- end }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdgate.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "pdgate.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "pdgate.notifySecret" -}}
{{- default (printf "%s-notify" (include "pdgate.fullname" .)) .Values.notificationSecret.existingSecret -}}
{{- end -}}

{{- define "pdgate.engineKeySecret" -}}
{{- default (printf "%s-engine-key" (include "pdgate.fullname" .)) .Values.engineApiKey.existingSecret -}}
{{- end -}}

{{- define "pdgate.adminKeySecret" -}}
{{- default (printf "%s-admin-key" (include "pdgate.fullname" .)) .Values.adminApiKey.existingSecret -}}
{{- end -}}

{{/* Where pdgate processes read their secrets (PDGATE_<FIELD>_FILE). */}}
{{- define "pdgate.secretsDir" -}}/var/run/secrets/pdgate{{- end -}}

{{/* The secret files a pdgate container gets, as YAML {files: [{env, secret, key}]}:
.component router (client keys, client_keys, notify secret, engine key, admin key) or shim (notify
secret, engine key). The file is named after the Secret key. */}}
{{- define "pdgate.secretFiles" -}}
{{- $v := .ctx.Values -}}
{{- $files := list -}}
{{- if and (eq .component "router") (include "pdgate.clientKeys" .ctx) -}}
{{- $files = append $files (dict "env" "PDGATE_API_KEYS_FILE" "secret" (include "pdgate.apiKeysSecret" .ctx) "key" "api-keys") -}}
{{- end -}}
{{- if and (eq .component "router") $v.clientKeys.existingSecret -}}
{{- $files = append $files (dict "env" "PDGATE_CLIENT_KEYS_FILE" "secret" $v.clientKeys.existingSecret "key" "client-keys") -}}
{{- end -}}
{{- if $v.notificationSecret.enabled -}}
{{- $files = append $files (dict "env" "PDGATE_NOTIFY_SECRET_FILE" "secret" (include "pdgate.notifySecret" .ctx) "key" "notify-secret") -}}
{{- end -}}
{{- $files = append $files (dict "env" "PDGATE_ENGINE_API_KEY_FILE" "secret" (include "pdgate.engineKeySecret" .ctx) "key" "engine-api-key") -}}
{{- if and (eq .component "router") $v.adminApiKey.enabled -}}
{{- $files = append $files (dict "env" "PDGATE_ADMIN_API_KEY_FILE" "secret" (include "pdgate.adminKeySecret" .ctx) "key" "admin-api-key") -}}
{{- end -}}
{{- toYaml (dict "files" $files) -}}
{{- end -}}

{{/* env entries pointing at the secret files (indent with nindent). */}}
{{- define "pdgate.secretEnv" -}}
{{- range (include "pdgate.secretFiles" . | fromYaml).files }}
- name: {{ .env }}
  value: {{ printf "%s/%s" (include "pdgate.secretsDir" $.ctx) .key | quote }}
{{- end -}}
{{- end -}}

{{/* The projected volume holding the secret files; empty when there are none. */}}
{{- define "pdgate.secretVolume" -}}
{{- $files := (include "pdgate.secretFiles" . | fromYaml).files -}}
{{- if $files }}
- name: secrets
  projected:
    defaultMode: 0440
    sources:
      {{- range $files }}
      - secret:
          name: {{ .secret }}
          items: [{key: {{ .key }}, path: {{ .key }}}]
      {{- end }}
{{- end -}}
{{- end -}}

{{- define "pdgate.secretMount" -}}
{{- if (include "pdgate.secretFiles" . | fromYaml).files }}
- {name: secrets, mountPath: {{ include "pdgate.secretsDir" .ctx }}, readOnly: true}
{{- end -}}
{{- end -}}

{{/* Selector labels of every pod of this release (router and engines). */}}
{{- define "pdgate.releaseLabels" -}}
app.kubernetes.io/name: {{ include "pdgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The router's YAML config: RouterConfig fields (router/config.py), nothing else. */}}
{{- define "pdgate.routerConfig" -}}
{{- $cfg := dict
  "model" .Values.model
  "host" "0.0.0.0"
  "port" .Values.router.port
  "workers" (int .Values.router.workers)
  "discovery" "k8s"
  "namespace" .Release.Namespace
  "prefill_selector" (include "pdgate.engineSelector" (dict "ctx" . "role" "prefill"))
  "decode_selector" (include "pdgate.engineSelector" (dict "ctx" . "role" "decode"))
  "prefill_port" (include "pdgate.enginePort" . | int)
  "decode_port" (include "pdgate.enginePort" . | int)
  "prefill_policy" .Values.router.prefillPolicy
  "decode_policy" .Values.router.decodePolicy
  "log_level" .Values.router.logLevel
  "drain_delay_s" (int .Values.router.drainDelaySeconds)
-}}
{{- if .Values.servedModelName -}}
{{- $_ := set $cfg "served_model_name" .Values.servedModelName -}}
{{- end -}}
{{- if .Values.tracing.endpoint -}}
{{- $_ := set $cfg "otlp_traces_endpoint" .Values.tracing.endpoint -}}
{{- end -}}
{{- if ne .Values.router.pdMode "pull" -}}
{{- $_ := set $cfg "pd_mode" .Values.router.pdMode -}}
{{- end -}}
{{- if .Values.models -}}
{{- /* Several models: each finds its pods by its name and role labels (engines.yaml). */ -}}
{{- $models := list -}}
{{- range $p := (include "pdgate.modelPlans" . | fromYaml).plans -}}
{{- $entry := dict "model" $p.model "served_model_name" $p.served "pd_mode" $p.pdMode -}}
{{- range $role := keys $p.pools -}}
{{- $_ := set $entry (printf "%s_selector" $role) (printf "%s,pdgate.io/model=%s" (include "pdgate.engineSelector" (dict "ctx" $ "role" $role)) $p.name) -}}
{{- end -}}
{{- $models = append $models (merge (deepCopy $p.routerConfig) $entry) -}}
{{- end -}}
{{- $cfg = omit $cfg "model" "served_model_name" "prefill_selector" "decode_selector" "pd_mode" -}}
{{- $_ := set $cfg "models" $models -}}
{{- end -}}
{{- if has "notify" (include "pdgate.modes" . | fromYaml).modes -}}
{{- /* Engines reach the proxy at the pod IP (PDGATE_NOTIFY_ADVERTISE_HOST, downward API). */ -}}
{{- $_ := set $cfg "notify_bind" (printf "tcp://0.0.0.0:%d" (int .Values.router.notifyPort)) -}}
{{- end -}}
{{- if .Values.engines.autoscaling.enabled -}}
{{- /* The capacity signal the ScaledObjects read comes from the measured-cost decider. */ -}}
{{- $_ := set $cfg "decider" "measured-cost" -}}
{{- end -}}
{{- toYaml (merge (deepCopy .Values.router.config) $cfg) -}}
{{- end -}}

{{/* The pd modes the release's models run, as {modes: [...]}. */}}
{{- define "pdgate.modes" -}}
{{- $modes := list -}}
{{- range $p := (include "pdgate.modelPlans" . | fromYaml).plans -}}
{{- $modes = append $modes $p.pdMode -}}
{{- end -}}
{{- toYaml (dict "modes" $modes) -}}
{{- end -}}

{{/* Fail early, with the values key in the message, on settings that cannot work. */}}
{{- define "pdgate.validate" -}}
{{- if and (not .Values.model) (not .Values.models) -}}
{{- fail "model: set the model the engines serve (a path under /models or a hub name), or models" -}}
{{- end -}}
{{- if not (has .Values.engines.kind (list "shim" "vllm")) -}}
{{- fail (printf "engines.kind: must be shim or vllm, not %q" .Values.engines.kind) -}}
{{- end -}}
{{- $names := list -}}
{{- range $i, $p := (include "pdgate.modelPlans" . | fromYaml).plans -}}
{{- $at := ternary "model" (printf "models[%d].model" $i) (eq $p.name "") -}}
{{- if ne $p.name "" -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$" (toString $p.name)) -}}
{{- fail (printf "models[%d].name: a lowercase DNS label of at most 40 characters (it names the model's Deployments and its pdgate.io/model label), not %q" $i (toString $p.name)) -}}
{{- end -}}
{{- if has $p.name $names -}}
{{- fail (printf "models[%d].name: %q names two models" $i $p.name) -}}
{{- end -}}
{{- $names = append $names $p.name -}}
{{- if not $p.model -}}
{{- fail (printf "%s: set the model the engines serve (a path under /models or a hub name)" $at) -}}
{{- end -}}
{{- if not (has $p.pdMode (list "pull" "notify" "push" "colocated")) -}}
{{- fail (printf "models[%d].pdMode: must be pull, notify, push or colocated, not %q" $i $p.pdMode) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $.Values.engines.kind "shim") (not (hasPrefix "/" (toString $p.model))) (ne (toString $p.model) "tiny") -}}
{{- fail (printf "%s: shim engines load a local directory (a path under /models, from modelVolume), not %q" $at (toString $p.model)) -}}
{{- end -}}
{{- if and (hasPrefix "/models" (toString $p.model)) (not $.Values.modelVolume) -}}
{{- fail (printf "modelVolume: %s is a path under /models, so a volume must be mounted there" $at) -}}
{{- end -}}
{{- if and (eq $.Values.engines.kind "vllm") (eq $p.pdMode "notify") (ne $p.name "") -}}
{{- fail (printf "models[%d].pdMode: vLLM engines support pull (NixlConnector), push (NixlPushConnector) and colocated; notify needs shim engines" $i) -}}
{{- end -}}
{{- range $role, $pool := $p.pools -}}
{{- if lt (int $pool.replicas) 1 -}}
{{- fail (printf "%s.replicas: at least one %s engine is needed" (ternary (printf "engines.%s" $role) (printf "models[%d].%s" $i $role) (eq $p.name "")) $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.engines.kind "vllm") (not .Values.engines.vllm.image.repository) -}}
{{- fail "engines.vllm.image.repository: set the vLLM image to run" -}}
{{- end -}}
{{- with .Values.engines.autoscaling -}}
{{- if .enabled -}}
{{- $decider := index $.Values.router.config "decider" | default "measured-cost" -}}
{{- if eq (kindOf $decider) "map" -}}{{- $decider = $decider.type -}}{{- end -}}
{{- if ne $decider "measured-cost" -}}
{{- fail "engines.autoscaling: the capacity signal comes from the measured-cost decider; router.config.decider must be measured-cost (or unset)" -}}
{{- end -}}
{{- range $i, $m := $.Values.models -}}
{{- $own := index (default dict $m.routerConfig) "decider" | default "measured-cost" -}}
{{- if eq (kindOf $own) "map" -}}{{- $own = $own.type -}}{{- end -}}
{{- if ne $own "measured-cost" -}}
{{- fail (printf "engines.autoscaling: the capacity signal comes from the measured-cost decider; models[%d].routerConfig.decider must be measured-cost (or unset)" $i) -}}
{{- end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $cfg := index $.Values.engines.autoscaling $role -}}
{{- if gt (int $cfg.minReplicaCount) (int $cfg.maxReplicaCount) -}}
{{- fail (printf "engines.autoscaling.%s: minReplicaCount must not exceed maxReplicaCount" $role) -}}
{{- end -}}
{{- end -}}
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
{{- $routerCfg := include "pdgate.routerConfig" . | fromYaml -}}
{{- /* 10: RouterConfig's shutdown_timeout_s default (tests/deploy/test_helm.py checks it) */ -}}
{{- $shutdown := ternary (index $routerCfg "shutdown_timeout_s") 10 (hasKey $routerCfg "shutdown_timeout_s") -}}
{{- $stop := add (int (ceil (index $routerCfg "drain_delay_s"))) (int (ceil $shutdown)) 5 -}}
{{- if lt (int .Values.router.terminationGracePeriodSeconds) (int $stop) -}}
{{- fail (printf "router.terminationGracePeriodSeconds: at least %d (the drain, drain_delay_s, plus shutdown_timeout_s plus 5 s), or Kubernetes kills the router while requests are still in flight" (int $stop)) -}}
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
{{- if not (has .Values.router.pdMode (list "pull" "notify" "push")) -}}
{{- fail (printf "router.pdMode: must be pull, notify or push, not %q" .Values.router.pdMode) -}}
{{- end -}}
{{- if and (eq .Values.engines.kind "vllm") (eq .Values.router.pdMode "notify") (not .Values.models) -}}
{{- fail "router.pdMode: vLLM engines support pull (NixlConnector) and push (NixlPushConnector); notify needs shim engines" -}}
{{- end -}}
{{- with .Values.engines.vllm.kvTransferConfig.kv_connector -}}
{{- if and (eq $.Values.engines.kind "vllm") (ne . (include "pdgate.vllmConnector" $)) -}}
{{- fail (printf "engines.vllm.kvTransferConfig.kv_connector: %s does not serve router.pdMode %s (leave it unset: the chart picks %s)" . $.Values.router.pdMode (include "pdgate.vllmConnector" $)) -}}
{{- end -}}
{{- end -}}
{{- if hasKey .Values.engineApiKey "enabled" -}}
{{- fail "engineApiKey.enabled: the engine key cannot be switched off (a shim on a pod IP refuses to start without one, and a vLLM engine without --api-key serves anyone); remove the setting" -}}
{{- end -}}
{{- if and .Values.engines.pdb.enabled (lt (int .Values.engines.pdb.maxUnavailable) 1) -}}
{{- fail "engines.pdb.maxUnavailable: at least 1, or no engine could ever be evicted (drains would hang)" -}}
{{- end -}}
{{- if and .Values.prometheusRule.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
{{- fail "prometheusRule.enabled: the cluster has no monitoring.coreos.com/v1 API (install the Prometheus operator first)" -}}
{{- end -}}
{{- if and .Values.tracing.endpoint (eq .Values.tracing.protocol "http/protobuf") (not (hasSuffix "/v1/traces" .Values.tracing.endpoint)) -}}
{{- fail "tracing.endpoint: with protocol http/protobuf, give the full URL ending in /v1/traces" -}}
{{- end -}}
{{- if and (has "notify" (include "pdgate.modes" . | fromYaml).modes) (not .Values.notificationSecret.enabled) -}}
{{- fail "notificationSecret.enabled: notify mode needs the secret, or the router's KV-ready proxy accepts unsigned notices" -}}
{{- end -}}
{{- range $key := list "engineApiKey" "adminApiKey" -}}
{{- $v := index $.Values $key -}}
{{- if and $v.value (lt (len $v.value) 16) -}}
{{- fail (printf "%s.value: use at least 16 characters" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
