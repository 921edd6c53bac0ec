{{/*
Names. The base name is "keyguard" (not .Chart.Name) so that an app chart that includes the
keyguard.sidecar.* templates with its own .Chart computes the same names as this chart does.
*/}}
{{- define "keyguard.name" -}}
{{- default "keyguard" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "keyguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "keyguard.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "keyguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "keyguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "keyguard.labels" -}}
{{ include "keyguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | quote }}
app.kubernetes.io/component: {{ .Values.mode }}
app.kubernetes.io/managed-by: {{ .Release.Service | default "Helm" }}
helm.sh/chart: keyguard
{{- end -}}

{{- define "keyguard.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ required "image.tag or image.digest is required" .Values.image.tag }}
{{- end -}}
{{- end -}}

{{- define "keyguard.configMapName" -}}
{{- .Values.existingConfigMap | default (printf "%s-config" (include "keyguard.fullname" .)) -}}
{{- end -}}

{{- define "keyguard.upstreamSecretName" -}}
{{- .Values.upstreamAuth.existingSecret | default (printf "%s-upstream" (include "keyguard.fullname" .)) -}}
{{- end -}}

{{- define "keyguard.hasUpstreamSecret" -}}
{{- if or .Values.upstreamAuth.existingSecret .Values.upstreamAuth.password -}}true{{- end -}}
{{- end -}}

{{- define "keyguard.listenAddress" -}}
{{- .Values.listenAddress | default (ternary "127.0.0.1" "0.0.0.0" (eq .Values.mode "sidecar")) -}}
{{- end -}}

{{- define "keyguard.validate" -}}
{{- if not (has .Values.mode (list "standalone" "sidecar")) -}}
{{- fail (printf "mode: must be standalone or sidecar, not %q" .Values.mode) -}}
{{- end -}}
{{- if not .Values.upstream -}}
{{- fail "upstream: the Redis address (HOST:PORT) is required" -}}
{{- end -}}
{{- end -}}

{{/*
The keyguard container as one list item (starts with "- name:"), for a Deployment's containers
or, as a native sidecar, an app pod's initContainers. Config from the ConfigMap volume, the
upstream Secret (when there is one) as files, probes on the admin port.
*/}}
{{- define "keyguard.container" -}}
{{- $native := and (eq .Values.mode "sidecar") .Values.sidecar.nativeSidecar -}}
- name: {{ ternary .Values.sidecar.containerName "keyguard" (eq .Values.mode "sidecar") }}
  image: {{ include "keyguard.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if $native }}
  restartPolicy: Always
  {{- end }}
  args:
    - --config
    - /etc/keyguard/keyguard.yaml
    - --listen
    - {{ printf "%s:%v" (include "keyguard.listenAddress" .) .Values.ports.redis | quote }}
    - --admin
    - {{ printf "0.0.0.0:%v" .Values.ports.admin | quote }}
    - --upstream
    - {{ .Values.upstream | quote }}
    - --threads
    - {{ .Values.threads | quote }}
    {{- range .Values.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- with .Values.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    - name: keyguard-redis
      containerPort: {{ .Values.ports.redis }}
      protocol: TCP
    - name: keyguard-admin
      containerPort: {{ .Values.ports.admin }}
      protocol: TCP
  {{- if $native }}
  startupProbe:
    httpGet:
      path: /healthz
      port: keyguard-admin
    periodSeconds: 1
    failureThreshold: 30
  {{- end }}
  {{- if .Values.probes.readiness.enabled }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: keyguard-admin
    periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
    timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
    failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  {{- end }}
  {{- if .Values.probes.liveness.enabled }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: keyguard-admin
    periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  {{- end }}
  {{- if and (eq .Values.mode "sidecar") (not $native) .Values.sidecar.preStopSleepSeconds }}
  lifecycle:
    preStop:
      exec:
        command: ["sleep", {{ .Values.sidecar.preStopSleepSeconds | quote }}]
  {{- end }}
  resources:
    {{- toYaml .Values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: keyguard-config
      mountPath: /etc/keyguard
      readOnly: true
    {{- if include "keyguard.hasUpstreamSecret" . }}
    - name: keyguard-upstream
      mountPath: /var/run/secrets/keyguard/upstream
      readOnly: true
    {{- end }}
{{- end -}}

{{/*
Pod volumes keyguard needs, as list items. The ConfigMap is mounted as a directory (not subPath)
so that updates reach the file and keyguard reloads them.
*/}}
{{- define "keyguard.volumes" -}}
- name: keyguard-config
  configMap:
    name: {{ include "keyguard.configMapName" . }}
{{- if include "keyguard.hasUpstreamSecret" . }}
- name: keyguard-upstream
  secret:
    secretName: {{ include "keyguard.upstreamSecretName" . }}
    items:
      - key: {{ .Values.upstreamAuth.usernameKey }}
        path: username
      - key: {{ .Values.upstreamAuth.passwordKey }}
        path: password
    optional: true
{{- end }}
{{- end -}}

{{/*
Sidecar mode, for app charts that list this chart as a dependency. Call each with keyguard's
values and the release, and put the app's Redis address at keyguard.sidecar.address:

  {{- $kg := dict "Values" .Values.keyguard "Release" .Release }}
  spec:
    initContainers:
      {{- include "keyguard.sidecar.initContainers" $kg | nindent 6 }}
    containers:
      - name: app
        env:
          - name: REDIS_ADDR
            value: {{ include "keyguard.sidecar.address" $kg | quote }}
      {{- include "keyguard.sidecar.containers" $kg | nindent 6 }}
    volumes:
      {{- include "keyguard.sidecar.volumes" $kg | nindent 6 }}

keyguard.sidecar is the container itself, for charts that place it themselves.
*/}}
{{- define "keyguard.sidecar" -}}
{{- $ctx := dict "Values" (merge (dict "mode" "sidecar") .Values) "Release" .Release -}}
{{- include "keyguard.container" $ctx -}}
{{- end -}}

{{- define "keyguard.sidecar.initContainers" -}}
{{- if .Values.sidecar.nativeSidecar -}}
{{ include "keyguard.sidecar" . }}
{{- end -}}
{{- end -}}

{{- define "keyguard.sidecar.containers" -}}
{{- if not .Values.sidecar.nativeSidecar -}}
{{ include "keyguard.sidecar" . }}
{{- end -}}
{{- end -}}

{{- define "keyguard.sidecar.volumes" -}}
{{ include "keyguard.volumes" . }}
{{- end -}}

{{- define "keyguard.sidecar.address" -}}
{{- printf "127.0.0.1:%v" .Values.ports.redis -}}
{{- end -}}
