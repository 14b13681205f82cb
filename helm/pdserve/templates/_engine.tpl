{{/* One engine pool: (dict "root" $ "role" "prefill"|"decode"), a Deployment; or, with
"group" G (pipeline parallelism, P > 1), pipeline group G of the pool: a StatefulSet of P pods,
pod k running stage k (docs/kubernetes.md, "Pipeline parallelism"). The prefill and decode
workloads differ only in their values block, their role and decode's KV-load policy. */}}
{{- define "pdserve.engine.deployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $pool := index $root.Values $role }}
{{- $ctx := dict "root" $root "component" $role }}
{{- $pp := int $root.Values.engine.pipelineParallelSize }}
{{- $group := "" }}
{{- $groupName := "" }}
{{- if hasKey . "group" }}
{{- $group = toString .group }}
{{- $groupName = printf "%s-%s" (include "pdserve.componentName" $ctx) $group }}
{{- end }}
{{- $tls := $root.Values.grpcTls }}
{{- $probePort := ternary $tls.healthPort 50051 $tls.enabled }}
{{- /* A pool's own value wins; null falls back to the shared engine value. */}}
{{- $tuning := dict }}
{{- range $key := list "maxNumSeqs" "maxNumBatchedTokens" "gpuMemoryUtilization" }}
{{- $own := index $pool $key }}
{{- $_ := set $tuning $key (kindIs "invalid" $own | ternary (index $root.Values.engine $key) $own) }}
{{- end }}
{{- /* Tensor and pipeline parallelism on GPUs: the pod gets one GPU per process, whatever
the pool's resources say (docs/kubernetes.md): N for a group's pod (one stage), P x N for
an engine pod running every stage (pipelinePodPerStage false). */}}
{{- /* A pool's own tensorParallelSize wins (the decode re-cuts another pool's KV:
docs/design.md §3 "KV between unlike grids"); null: engine.tensorParallelSize. */}}
{{- $ownTp := index $pool "tensorParallelSize" }}
{{- $tp := int (kindIs "invalid" $ownTp | ternary $root.Values.engine.tensorParallelSize $ownTp) }}
{{- $gpus := ternary $tp (mul $tp $pp) (ne $group "") }}
{{- $resources := deepCopy (default (dict) $pool.resources) }}
{{- if and (gt (int $gpus) 1) (eq $root.Values.engine.device "cuda") }}
{{- range $part := list "requests" "limits" }}
{{- $r := default (dict) (index $resources $part) }}
{{- $_ := set $r "nvidia.com/gpu" (toString $gpus) }}
{{- $_ := set $resources $part $r }}
{{- end }}
{{- end }}
{{- /* The service drains (NOT_SERVING, finish in-flight) for drainGrace seconds after
SIGTERM, which comes after the preStop sleep; keep 10 s for the process to exit. */}}
{{- $drain := sub (int $pool.terminationGracePeriodSeconds) (add (int $pool.preStopSleepSeconds) 10) }}
{{- if le (int $drain) 0 }}
{{- fail (printf "%s.terminationGracePeriodSeconds must exceed preStopSleepSeconds + 10 (drain time)" $role) }}
{{- end }}
apiVersion: apps/v1
{{- if $group }}
kind: StatefulSet
metadata:
  name: {{ $groupName }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
    {{ include "pdserve.pipelineGroupLabel" $group }}
spec:
  # One pod per stage: pod k (label apps.kubernetes.io/pod-index) runs stage k.
  replicas: {{ $pp }}
  serviceName: {{ $groupName }}
  # All stages start at once: the leader is ready only when every stage has joined, so
  # OrderedReady would never start pod 1.
  podManagementPolicy: Parallel
  revisionHistoryLimit: 5
  updateStrategy:
    type: RollingUpdate
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
      {{ include "pdserve.pipelineGroupLabel" $group }}
{{- else }}
kind: Deployment
metadata:
  name: {{ include "pdserve.componentName" $ctx }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not $root.Values.autoscaler.enabled }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    {{- toYaml $pool.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
{{- end }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $ctx | nindent 8 }}
        {{- if $group }}
        {{ include "pdserve.pipelineGroupLabel" $group }}
        {{- end }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $pool.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "pdserve.serviceAccountName" (dict "root" $root "component" "engine") }}
      # Engines never call the Kubernetes API.
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      # preStop sleep + drain (finish in-flight, refuse new, NOT_SERVING) must fit in here.
      terminationGracePeriodSeconds: {{ $pool.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with (include "pdserve.modelInit" (dict "root" $root "tokenizerOnly" false) | trim) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["pdserve", {{ $role | quote }}]
          envFrom:
            - configMapRef:
                name: {{ include "pdserve.fullname" $root }}
          env:
            - name: PDSERVE_HOST
              value: "0.0.0.0"
            - name: PDSERVE_PORT
              value: "50051"
            - name: PDSERVE_METRICS_PORT
              value: "9090"
            - name: PDSERVE_DRAIN_GRACE
              value: {{ $drain | quote }}
            {{- /* int: a values file's numbers are floats to Helm, and 2000000 would
            render as "2e+06", which no integer flag takes. */}}
            - name: PDSERVE_MAX_NUM_SEQS
              value: {{ $tuning.maxNumSeqs | int | quote }}
            - name: PDSERVE_MAX_NUM_BATCHED_TOKENS
              value: {{ $tuning.maxNumBatchedTokens | int | quote }}
            - name: PDSERVE_GPU_MEMORY_UTILIZATION
              value: {{ $tuning.gpuMemoryUtilization | quote }}
            {{- if not (kindIs "invalid" $ownTp) }}
            - name: PDSERVE_TENSOR_PARALLEL_SIZE  # this pool's own (env wins over the ConfigMap)
              value: {{ $tp | quote }}
            {{- end }}
            {{- if eq $role "decode" }}
            - name: PDSERVE_KV_LOAD_FAILURE
              value: {{ $pool.kvLoadFailure | quote }}
            {{- end }}
            {{- if eq $root.Values.connector.type "p2p" }}
            # Where decode pods pull this pod's KV from (it goes into the handles).
            - name: PDSERVE_P2P_HOST
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- end }}
            {{- if $group }}
            # This pod's stage is its ordinal; every stage dials stage 0's stable DNS name.
            - name: PDSERVE_PIPELINE_STAGE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
            - name: PDSERVE_PIPELINE_LEADER
              value: {{ printf "%s-0.%s.%s.svc:%d" $groupName $groupName $root.Release.Namespace (int $root.Values.engine.pipelinePort) | quote }}
            {{- end }}
            {{- with include "pdserve.grpcTokenEnv" $root }}{{ . | nindent 12 }}{{ end }}
            {{- with include "pdserve.tracingEnv" $root }}{{ . | nindent 12 }}{{ end }}
            {{- with include "pdserve.grpcTlsEnv" (dict "root" $root "side" "engine") }}{{ . | nindent 12 }}{{ end }}
            {{- with include "pdserve.kvSecretEnv" $root }}{{ . | nindent 12 }}{{ end }}
            {{- with include "pdserve.redisEnv" $root }}{{ . | nindent 12 }}{{ end }}
            - name: HOME
              value: /tmp
            {{- with $pool.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: 50051
              protocol: TCP
            - name: metrics
              containerPort: 9090
              protocol: TCP
            {{- if $group }}
            - name: pipeline
              containerPort: {{ $root.Values.engine.pipelinePort }}
              protocol: TCP
            {{- end }}
            {{- if $tls.enabled }}
            - name: grpc-health
              containerPort: {{ $tls.healthPort }}
              protocol: TCP
            {{- end }}
            {{- if eq $root.Values.connector.type "p2p" }}
            - name: p2p
              containerPort: {{ $root.Values.connector.p2p.port }}
              protocol: TCP
            {{- range $rank := untilStep 1 $tp 1 }}
            # Tensor-parallel rank {{ $rank }}'s own p2p control port.
            - name: p2p-{{ $rank }}
              containerPort: {{ add $root.Values.connector.p2p.port $rank }}
              protocol: TCP
            {{- end }}
            {{- end }}
          # With mTLS the kubelet (no client certificate) probes the plaintext health port.
          startupProbe:
            grpc:
              port: {{ $probePort }}
            {{- toYaml $pool.startupProbe | nindent 12 }}
          readinessProbe:
            grpc:
              port: {{ $probePort }}
            {{- toYaml $pool.readinessProbe | nindent 12 }}
          livenessProbe:
            tcpSocket:
              port: grpc
            {{- toYaml $pool.livenessProbe | nindent 12 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $pool.preStopSleepSeconds }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            - name: tmp
              mountPath: /tmp
            # Shared memory for torch (the default 64Mi /dev/shm is too small).
            - name: dshm
              mountPath: /dev/shm
            {{- if eq (include "pdserve.storeKind" $root) "fs" }}
            - name: kv
              mountPath: {{ $root.Values.connector.fs.mountPath }}
            {{- end }}
            {{- if and $root.Values.lora.enabled $root.Values.lora.volume }}
            - name: lora-adapters
              mountPath: {{ $root.Values.lora.mountPath }}
              readOnly: true
            {{- end }}
            {{- with include "pdserve.grpcTlsMount" $root }}{{ . | nindent 12 }}{{ end }}
      volumes:
        {{- include "pdserve.modelVolume" $root | nindent 8 }}
        - name: tmp
          emptyDir: {}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.engine.shmSizeLimit }}
        {{- if eq (include "pdserve.storeKind" $root) "fs" }}
        - name: kv
          persistentVolumeClaim:
            claimName: {{ include "pdserve.kvClaimName" $root }}
        {{- end }}
        {{- if and $root.Values.lora.enabled $root.Values.lora.volume }}
        - name: lora-adapters
          {{- toYaml $root.Values.lora.volume | nindent 10 }}
        {{- end }}
        {{- with include "pdserve.grpcTlsVolume" (dict "root" $root "side" "engine") }}{{ . | nindent 8 }}{{ end }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/* Headless Service of one pool: one DNS record / EndpointSlice entry per ready pod,
which is what the router's discovery reads. */}}
{{- define "pdserve.engine.service" -}}
{{- $ctx := dict "root" .root "component" .role }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "pdserve.componentName" $ctx }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  # Only ready pods: a draining pod (NOT_SERVING) leaves discovery at once.
  publishNotReadyAddresses: false
  selector:
    {{- include "pdserve.selectorLabels" $ctx | nindent 4 }}
    {{- if include "pdserve.pipelineGroups" .root }}
    # Pipeline groups: only stage 0 (the leader) serves requests; the router sees leaders only.
    apps.kubernetes.io/pod-index: "0"
    {{- end }}
  ports:
    - name: grpc
      port: 50051
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: 9090
      targetPort: metrics
      protocol: TCP
{{- end }}

{{/* The per-group headless Service that gives a pipeline group's pods stable DNS names
(<group>-<k>.<group>.<namespace>.svc): the stages find the leader through it before anyone
is ready, so it publishes not-ready addresses. */}}
{{- define "pdserve.engine.groupService" -}}
{{- $ctx := dict "root" .root "component" .role }}
{{- $groupName := printf "%s-%s" (include "pdserve.componentName" $ctx) (toString .group) }}
apiVersion: v1
kind: Service
metadata:
  name: {{ $groupName }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
    {{ include "pdserve.pipelineGroupLabel" (toString .group) }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "pdserve.selectorLabels" $ctx | nindent 4 }}
    {{ include "pdserve.pipelineGroupLabel" (toString .group) }}
  ports:
    - name: pipeline
      port: {{ .root.Values.engine.pipelinePort }}
      targetPort: pipeline
      protocol: TCP
{{- end }}

{{/* Non-empty when each engine replica is a pipeline group of one pod per stage. */}}
{{- define "pdserve.pipelineGroups" -}}
{{- if and (gt (int .Values.engine.pipelineParallelSize) 1) .Values.engine.pipelinePodPerStage }}true{{ end }}
{{- end }}

{{- define "pdserve.pipelineGroupLabel" -}}
pdserve.io/pipeline-group: {{ . | quote }}
{{- end }}

{{/* One pool: its Deployment, or (P > 1) one StatefulSet and Service per pipeline group;
and the pool's headless Service, which the router's discovery reads. */}}
{{- define "pdserve.engine.pool" -}}
{{- $pool := index .root.Values .role }}
{{- if include "pdserve.pipelineGroups" .root }}
{{- if .root.Values.autoscaler.enabled }}
{{- fail "autoscaler.enabled needs engine.pipelineParallelSize 1: the autoscaler scales Deployments, and a pipeline group is a StatefulSet per group" }}
{{- end }}
{{- range $g := until (int $pool.replicas) }}
{{ include "pdserve.engine.deployment" (dict "root" $.root "role" $.role "group" $g) }}
---
{{ include "pdserve.engine.groupService" (dict "root" $.root "role" $.role "group" $g) }}
---
{{- end }}
{{- else }}
{{ include "pdserve.engine.deployment" (dict "root" .root "role" .role) }}
---
{{- end }}
{{ include "pdserve.engine.service" (dict "root" .root "role" .role) }}
{{- end }}
