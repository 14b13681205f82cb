{{/* One engine pool: (dict "root" $ "role" "prefill"|"decode"). The prefill and decode
Deployments differ only in their values block, their role and decode's KV-load policy. */}}
{{- define "pdserve.engine.deployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $pool := index $root.Values $role }}
{{- $ctx := dict "root" $root "component" $role }}
{{- $tls := $root.Values.grpcTls }}
{{- $probePort := ternary $tls.healthPort 50051 $tls.enabled }}
{{- /* A pool's own value wins; null falls back to the shared engine value. */}}
{{- $tuning := dict }}
{{- range $key := list "maxNumSeqs" "maxNumBatchedTokens" "gpuMemoryUtilization" }}
{{- $own := index $pool $key }}
{{- $_ := set $tuning $key (kindIs "invalid" $own | ternary (index $root.Values.engine $key) $own) }}
{{- end }}
{{- /* Tensor parallelism on GPUs: the pod gets one GPU per rank, whatever the pool's
resources say (docs/kubernetes.md). */}}
{{- $tp := int $root.Values.engine.tensorParallelSize }}
{{- $resources := deepCopy (default (dict) $pool.resources) }}
{{- if and (gt $tp 1) (eq $root.Values.engine.device "cuda") }}
{{- range $part := list "requests" "limits" }}
{{- $r := default (dict) (index $resources $part) }}
{{- $_ := set $r "nvidia.com/gpu" (toString $tp) }}
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
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $ctx | nindent 8 }}
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
            - name: PDSERVE_MAX_NUM_SEQS
              value: {{ $tuning.maxNumSeqs | quote }}
            - name: PDSERVE_MAX_NUM_BATCHED_TOKENS
              value: {{ $tuning.maxNumBatchedTokens | quote }}
            - name: PDSERVE_GPU_MEMORY_UTILIZATION
              value: {{ $tuning.gpuMemoryUtilization | quote }}
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
            {{- with include "pdserve.grpcTokenEnv" $root }}{{ . | nindent 12 }}{{ end }}
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
