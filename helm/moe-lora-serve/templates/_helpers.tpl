{{/* Names, labels and pieces every template shares. */}}

{{- define "moelora.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; component names append "-registry" etc., so keep room. */}}
{{- define "moelora.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "moelora.registry.fullname" -}}
{{- printf "%s-registry" (include "moelora.fullname" .) }}
{{- end }}

{{- define "moelora.executor.fullname" -}}
{{- printf "%s-executor" (include "moelora.fullname" .) }}
{{- end }}

{{/* The executors' headless Service: one DNS A record per ready pod. */}}
{{- define "moelora.executor.headless" -}}
{{- printf "%s-executor-headless" (include "moelora.fullname" .) }}
{{- end }}

{{- define "moelora.registry.address" -}}
{{- printf "%s.%s.svc:%d" (include "moelora.registry.fullname" .) .Release.Namespace (int .Values.registry.port) }}
{{- end }}

{{/* The base of the signed blob URLs the registry hands out (local blobs only). */}}
{{- define "moelora.registry.httpUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "moelora.registry.fullname" .) .Release.Namespace (int .Values.registry.httpPort) }}
{{- end }}

{{- define "moelora.executor.dnsTarget" -}}
{{- printf "dns:///%s.%s.svc:%d" (include "moelora.executor.headless" .) .Release.Namespace (int .Values.executor.port) }}
{{- end }}

{{/* Selector labels: stable across upgrades (Deployment and StatefulSet selectors are immutable). */}}
{{- define "moelora.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moelora.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "moelora.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "moelora.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: moe-lora-serve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* metadata.annotations: commonAnnotations and the object's own (.extra, which wins);
nothing when both are empty. */}}
{{- define "moelora.annotations" -}}
{{- $all := mergeOverwrite (deepCopy (default dict .root.Values.commonAnnotations)) (default dict .extra) }}
{{- with $all }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* image: repository:tag, or repository@digest when a digest is given. */}}
{{- define "moelora.image" -}}
{{- if .image.digest -}}
{{ .image.repository }}@{{ .image.digest }}
{{- else -}}
{{ .image.repository }}:{{ default .root.Chart.AppVersion .image.tag }}
{{- end }}
{{- end }}

{{- define "moelora.serviceAccountName" -}}
{{- $sa := index .root.Values .component "serviceAccount" }}
{{- if $sa.create }}
{{- default (printf "%s-%s" (include "moelora.fullname" .root) .component) $sa.name }}
{{- else }}
{{- default "default" $sa.name }}
{{- end }}
{{- end }}

{{/* The registry's SQLAlchemy URL, from the existing Secret; never inlined. */}}
{{- define "moelora.databaseUrlEnv" -}}
- name: MOELORA_REGISTRY_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.registry.database.existingSecret }}
      key: {{ .Values.registry.database.urlKey }}
{{- end }}

{{/* S3 connection settings and credentials (for the registry's blobs and the model fetch). */}}
{{- define "moelora.s3Env" -}}
{{- with .Values.s3.endpointUrl }}
- name: MOELORA_REGISTRY_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.s3.region }}
- name: MOELORA_REGISTRY_S3_REGION
  value: {{ . | quote }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
- name: MOELORA_REGISTRY_S3_PATH_STYLE
  value: {{ .Values.s3.pathStyle | quote }}
{{- with .Values.s3.credentials.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.credentials.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.credentials.secretAccessKeyKey }}
{{- end }}
{{- end }}

{{/* Pod-level security defaults, merged with the component's overrides. */}}
{{- define "moelora.podSecurityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.podSecurityContext) (default dict .overrides)) }}
{{- end }}

{{/* Seconds a pod may take to stop: the preStop pause, the drain, and a margin. */}}
{{- define "moelora.terminationGrace" -}}
{{- add (int .preStopSleepSeconds) (int (ceil .drainSeconds)) 15 }}
{{- end }}

{{/* Pods allowed to reach the registry or executors in tests: this release's `helm test` pod. */}}
{{- define "moelora.testPeer" -}}
- podSelector:
    matchLabels:
      {{- include "moelora.selectorLabels" (dict "root" . "component" "test") | nindent 6 }}
{{- end }}

{{/* A client peer: a podSelector, optionally combined with a namespaceSelector. */}}
{{- define "moelora.clientPeer" -}}
- podSelector:
    {{- toYaml .podSelector | nindent 4 }}
  {{- if not (kindIs "invalid" .namespaceSelector) }}
  namespaceSelector:
    {{- toYaml .namespaceSelector | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The metrics port's ingress rule: from the configured scrapers, or from anywhere. */}}
{{- define "moelora.metricsIngress" -}}
- ports:
    - port: metrics
      protocol: TCP
  {{- with .Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{- define "moelora.dnsEgress" -}}
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end }}

{{/* Whether the registry keeps anything in /data: SQLite or local blobs. */}}
{{- define "moelora.registry.needsData" -}}
{{- if or (eq .Values.registry.database.type "sqlite") (not .Values.registry.blobUrl) }}true{{ end }}
{{- end }}

{{/* Where the executor reads its checkpoint. */}}
{{- define "moelora.executor.modelPath" -}}
{{- $sub := trimAll "/" .Values.executor.model.subPath }}
{{- if $sub }}/models/{{ $sub }}{{ else }}/models{{ end }}
{{- end }}

{{/* Liveness fails on NOT_SERVING, which a draining server reports: refuse budgets that
would restart a pod in the middle of its drain. */}}
{{- define "moelora.checkLivenessOutlastsDrain" -}}
{{- $budget := mul (int .liveness.periodSeconds) (int .liveness.failureThreshold) }}
{{- $stop := add (int .c.preStopSleepSeconds) (int (ceil .c.drainSeconds)) }}
{{- if le (int $budget) (int $stop) }}
{{- fail (printf "%s: liveness periodSeconds x failureThreshold (%ds) must exceed preStopSleepSeconds + drainSeconds (%ds)" .name (int $budget) (int $stop)) }}
{{- end }}
{{- end }}

{{/* The registry's pods and its migration Job's: what may reach the database. */}}
{{- define "moelora.registryAndMigrationSelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "moelora.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [registry, migration]
{{- end }}

{{/* The registry's env entries beyond its ConfigMap: Secret references and extraEnv. */}}
{{- define "moelora.registry.env" -}}
{{- if eq .Values.registry.database.type "postgresql" }}
{{ include "moelora.databaseUrlEnv" . }}
{{- end }}
{{- if .Values.registry.blobUrl }}
{{ include "moelora.s3Env" . | trim }}
{{- end }}
{{- with .Values.registry.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The Secret and key of the token file the executors check: executor.auth's, else the registry's. */}}
{{- define "moelora.executor.tokensSecret" -}}
{{- .Values.executor.auth.tokensSecret | default .Values.auth.tokensSecret -}}
{{- end }}
{{- define "moelora.executor.tokensKey" -}}
{{- if .Values.executor.auth.tokensSecret }}{{ .Values.executor.auth.tokensSecretKey }}{{ else }}{{ .Values.auth.tokensSecretKey }}{{ end -}}
{{- end }}

{{/* The executor's env entries beyond its ConfigMap: its group's layers and replica name,
the network channels' address (the pod IP), the registry token and extraEnv. */}}
{{- define "moelora.executor.env" -}}
{{- with .g.layers }}
- name: MOELORA_EXECUTOR_LAYERS
  value: {{ . | quote }}
{{- end }}
{{- if .g.group }}
- name: MOELORA_EXECUTOR_REPLICA_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
{{- if .root.Values.executor.networkChannels.enabled }}
- name: MOELORA_EXECUTOR_NETWORK_CHANNEL_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}
{{- if .root.Values.auth.enabled }}
- name: MOELORA_EXECUTOR_REGISTRY_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.auth.executorTokenSecret }}
      key: {{ .root.Values.auth.executorTokenSecretKey }}
{{- end }}
{{- with .root.Values.executor.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Executor groups (executor.groups): each its own StatefulSet, headless Service and PDB
serving its layers. Without groups, one unnamed group: the single executor, named as always.
resolveGroup fills .out with the group's name, StatefulSet and Service names, and the
executor values with the group's overrides. */}}
{{- define "moelora.executor.groupList" -}}
{{- $names := list }}
{{- range .Values.executor.groups }}
{{- if has .name $names }}
{{- fail (printf "executor.groups: the name %q is used twice" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- end }}
{{- if and .Values.executor.groups .Values.executor.autoscaling.enabled }}
{{- fail "executor.autoscaling is for the single executor; with executor.groups set each group's replicas" }}
{{- end }}
{{- end }}

{{- define "moelora.executor.resolveGroup" -}}
{{- $e := deepCopy .root.Values.executor }}
{{- $name := include "moelora.executor.fullname" .root }}
{{- if .group.name }}
{{- range $k, $v := omit .group "name" "layers" "gpu" }}
{{- $_ := set $e $k $v }}
{{- end }}
{{- with .group.gpu }}
{{- $_ := set $e "gpu" (merge (deepCopy .) $e.gpu) }}
{{- end }}
{{- /* 52 at most: StatefulSet pods carry NAME-<10-char hash> as a label value. */}}
{{- $name = printf "%s-%s" ($name | trunc (int (sub 51 (len .group.name))) | trimSuffix "-") .group.name }}
{{- $_ := set .out "headless" (printf "%s-headless" $name) }}
{{- else }}
{{- $_ := set .out "headless" (include "moelora.executor.headless" .root) }}
{{- end }}
{{- $_ := set .out "e" $e }}
{{- $_ := set .out "name" $name }}
{{- $_ := set .out "group" (.group.name | default "") }}
{{- $_ := set .out "layers" (.group.layers | default "") }}
{{- end }}

{{/* Selector labels of one executor group: the executor's, plus the group's name. */}}
{{- define "moelora.executor.selectorLabels" -}}
{{ include "moelora.selectorLabels" (dict "root" .root "component" "executor") }}
{{- with .group }}
moelora.io/executor-group: {{ . }}
{{- end }}
{{- end }}

{{- define "moelora.executor.labels" -}}
{{ include "moelora.labels" (dict "root" .root "component" "executor") }}
{{- with .group }}
moelora.io/executor-group: {{ . }}
{{- end }}
{{- end }}
