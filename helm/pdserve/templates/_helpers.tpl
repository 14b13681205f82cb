{{/* Chart name, truncated to the 63-character DNS label limit. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix: "<release>-<chart>" unless the release name already has it.
Truncated so that "-<component>" suffixes still fit 63 characters. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 42 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 42 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 42 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one component's objects: (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .component }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: the minimal, immutable set. Never add version-like labels here:
Deployment selectors cannot change, so an upgrade would fail. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects. */}}
{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
helm.sh/chart: {{ include "pdserve.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* ServiceAccount of a component: (dict "root" $ "component" "router"). */}}
{{- define "pdserve.serviceAccountName" -}}
{{- if .root.Values.serviceAccount.create }}
{{- include "pdserve.componentName" . }}
{{- else }}
{{- "default" }}
{{- end }}
{{- end }}

{{/* Model directory as seen by the containers (--model). */}}
{{- define "pdserve.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.dir }}
{{- end }}

{{/* The volume that holds the model. */}}
{{- define "pdserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.emptyDir.sizeLimit }}
{{- end }}
{{- end }}

{{/* Init container that fills the emptyDir (pull/huggingface); nothing otherwise.
(dict "root" $ "tokenizerOnly" bool): the router only needs tokenizer and config files. */}}
{{- define "pdserve.modelInit" -}}
{{- $v := .root.Values }}
{{- if has $v.model.source (list "pull" "huggingface") }}
- name: fetch-model
  image: {{ include "pdserve.image" .root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if eq $v.model.source "pull" }}
  command: ["pdserve", "models", "pull", {{ $v.model.pull.name | quote }}, "--cache-dir", {{ $v.model.mountPath | quote }}{{ range $v.model.pull.extraArgs }}, {{ . | quote }}{{ end }}]
  {{- else }}
  command:
    - hf
    - download
    - {{ required "model.huggingface.repo is required when model.source=huggingface" $v.model.huggingface.repo | quote }}
    - --revision
    - {{ $v.model.huggingface.revision | quote }}
    - --local-dir
    - {{ include "pdserve.modelPath" .root | quote }}
    {{- if .tokenizerOnly }}
    {{- range $v.model.huggingface.routerInclude }}
    - --include
    - {{ . | quote }}
    {{- end }}
    {{- end }}
  {{- end }}
  env:
    - name: HOME
      value: /tmp
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if and (eq $v.model.source "huggingface") $v.model.huggingface.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $v.model.huggingface.tokenSecret.name }}
          key: {{ $v.model.huggingface.tokenSecret.key }}
    {{- end }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    {{- toYaml $v.model.initResources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $v.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* "true" when the chart deploys its own Redis (store redis, no external URL). */}}
{{- define "pdserve.redisInChart" -}}
{{- $r := .Values.connector.redis }}
{{- if and (eq (include "pdserve.storeKind" .) "redis") (not $r.url) (not $r.urlSecret.name) }}true{{ end }}
{{- end }}

{{/* Secret holding the in-chart Redis password: the given one, or the chart's own. */}}
{{- define "pdserve.redisAuthSecret" -}}
{{- default (include "pdserve.componentName" (dict "root" . "component" "redis-auth")) .Values.connector.redis.auth.existingSecret }}
{{- end }}

{{/* PDSERVE_REDIS_URL of the engines when it carries a password, so never from the
ConfigMap: in-chart Redis = REDIS_PASSWORD from its Secret, put into the URL by
Kubernetes' $(VAR) expansion; external Redis with urlSecret = the whole URL from it. */}}
{{- define "pdserve.redisEnv" -}}
{{- $r := .Values.connector.redis }}
{{- if include "pdserve.redisInChart" . -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisAuthSecret" . }}
      key: {{ $r.auth.key }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "pdserve.componentName" (dict "root" . "component" "redis")) | quote }}
{{- else if and (eq (include "pdserve.storeKind" .) "redis") $r.urlSecret.name -}}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.urlSecret.name }}
      key: {{ $r.urlSecret.key }}
{{- end }}
{{- end }}

{{/* The Redis in use, for NOTES.txt (never the password). */}}
{{- define "pdserve.redisShownUrl" -}}
{{- $r := .Values.connector.redis }}
{{- if include "pdserve.redisInChart" . }}
{{- printf "redis://%s:6379/0, password in Secret %s" (include "pdserve.componentName" (dict "root" . "component" "redis")) (include "pdserve.redisAuthSecret" .) }}
{{- else if $r.urlSecret.name }}
{{- printf "URL in Secret %s" $r.urlSecret.name }}
{{- else }}
{{- $r.url }}
{{- end }}
{{- end }}

{{/* Namespace of every store key: kvKeyPrefix, or "<release>/" (one per deployment). */}}
{{- define "pdserve.kvKeyPrefix" -}}
{{- default (printf "%s/" .Release.Name) .Values.kvKeyPrefix }}
{{- end }}

{{- define "pdserve.lmcacheUrl" -}}
{{- if .Values.connector.lmcache.url }}
{{- .Values.connector.lmcache.url }}
{{- else }}
{{- printf "lm://%s:%d" (include "pdserve.componentName" (dict "root" . "component" "lmcache")) (int .Values.connector.lmcache.port) }}
{{- end }}
{{- end }}

{{/* The store in use: connector.type, or with a handoff (p2p, nixl) the store beside it ("none": the handoff alone). */}}
{{- define "pdserve.storeKind" -}}
{{- if has .Values.connector.type (list "p2p" "nixl") }}{{ .Values.connector.p2p.store }}{{ else }}{{ .Values.connector.type }}{{ end }}
{{- end }}

{{/* Claim name of the shared fs KV volume. */}}
{{- define "pdserve.kvClaimName" -}}
{{- default (include "pdserve.componentName" (dict "root" . "component" "kv")) .Values.connector.fs.existingClaim }}
{{- end }}

{{/* PDSERVE_GRPC_TOKEN from grpcToken.existingSecret (engines and router alike), if set. */}}
{{- define "pdserve.grpcTokenEnv" -}}
{{- with .Values.grpcToken.existingSecret -}}
- name: PDSERVE_GRPC_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.grpcToken.key }}
{{- end }}
{{- end }}

{{/* mTLS (grpcTls): the Secret of (dict "root" $ "side" "engine"|"router"), or fail. */}}
{{- define "pdserve.grpcTlsSecret" -}}
{{- $tls := .root.Values.grpcTls }}
{{- $name := ternary $tls.engineSecret $tls.routerSecret (eq .side "engine") }}
{{- if not $name }}
{{- fail (printf "grpcTls.enabled needs grpcTls.%sSecret (a Secret with tls.crt, tls.key, ca.crt)" .side) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* The name the router checks in the engines' certificates. */}}
{{- define "pdserve.grpcTlsServerName" -}}
{{- default (include "pdserve.componentName" (dict "root" . "component" "engine")) .Values.grpcTls.serverName }}
{{- end }}

{{/* PDSERVE_GRPC_TLS_* of (dict "root" $ "side" "engine"|"router"), if grpcTls.enabled:
the mounted files, and the side's own settings. */}}
{{- define "pdserve.grpcTlsEnv" -}}
{{- $tls := .root.Values.grpcTls }}
{{- if $tls.enabled -}}
- name: PDSERVE_GRPC_TLS_CERT
  value: {{ printf "%s/tls.crt" $tls.mountPath | quote }}
- name: PDSERVE_GRPC_TLS_KEY
  value: {{ printf "%s/tls.key" $tls.mountPath | quote }}
- name: PDSERVE_GRPC_TLS_CA
  value: {{ printf "%s/ca.crt" $tls.mountPath | quote }}
{{- if eq .side "router" }}
- name: PDSERVE_GRPC_TLS_SERVER_NAME
  value: {{ include "pdserve.grpcTlsServerName" .root | quote }}
{{- else }}
- name: PDSERVE_GRPC_HEALTH_PORT
  value: {{ $tls.healthPort | quote }}
{{- with $tls.allowedClients }}
- name: PDSERVE_GRPC_ALLOWED_CLIENTS
  value: {{ join "," . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The volumeMount of the mTLS Secret, if grpcTls.enabled. */}}
{{- define "pdserve.grpcTlsMount" -}}
{{- if .Values.grpcTls.enabled -}}
- name: grpc-tls
  mountPath: {{ .Values.grpcTls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The volume of the mTLS Secret of (dict "root" $ "side" ...), if grpcTls.enabled; only
the three keys, group-readable (fsGroup) and nothing else. */}}
{{- define "pdserve.grpcTlsVolume" -}}
{{- if .root.Values.grpcTls.enabled -}}
- name: grpc-tls
  secret:
    secretName: {{ include "pdserve.grpcTlsSecret" . }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end }}

{{/* PDSERVE_KV_SECRET from kvSecret.existingSecret (prefill and decode only), if set. */}}
{{- define "pdserve.kvSecretEnv" -}}
{{- with .Values.kvSecret.existingSecret -}}
- name: PDSERVE_KV_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.kvSecret.key }}
{{- end }}
{{- end }}

{{/* PDSERVE_OTLP_TRACES_ENDPOINT, if tracing.otlpTracesEndpoint is set (router and engines). */}}
{{- define "pdserve.tracingEnv" -}}
{{- with .Values.tracing.otlpTracesEndpoint -}}
- name: PDSERVE_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end }}
