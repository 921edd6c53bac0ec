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

{{- define "keyguard.sentinelSecretName" -}}
{{- .Values.sentinel.existingSecret | default (printf "%s-sentinel" (include "keyguard.fullname" .)) -}}
{{- end -}}

{{- define "keyguard.hasSentinelSecret" -}}
{{- if or .Values.sentinel.existingSecret .Values.sentinel.password -}}true{{- end -}}
{{- end -}}

{{- define "keyguard.tenantsSecretName" -}}
{{- .Values.tenancy.existingSecret | default (printf "%s-tenants" (include "keyguard.fullname" .)) -}}
{{- end -}}

{{- define "keyguard.hasTenantsSecret" -}}
{{- if or .Values.tenancy.existingSecret .Values.tenancy.users -}}true{{- end -}}
{{- end -}}

{{/* Where the Secrets are mounted; the rendered config names these files. */}}
{{- define "keyguard.upstreamPasswordFile" -}}/var/run/secrets/keyguard/upstream/password{{- end -}}
{{- define "keyguard.tenantsUsersFile" -}}/var/run/secrets/keyguard/tenants/users.yaml{{- end -}}
{{- define "keyguard.sentinelPasswordFile" -}}/var/run/secrets/keyguard/sentinel/password{{- end -}}
{{- define "keyguard.upstreamTlsDir" -}}/var/run/secrets/keyguard/upstream-tls{{- end -}}
{{- define "keyguard.listenTlsDir" -}}/var/run/secrets/keyguard/listen-tls{{- end -}}

{{/*
The files of a TLS Secret the pod mounts: {config field: Secret key} for the keys that are set.
Called with (list "upstream"|"listen" .).
*/}}
{{- define "keyguard.tlsFiles" -}}
{{- $v := ternary (index . 1).Values.upstreamTls (index . 1).Values.listenTls (eq (index . 0) "upstream") -}}
{{- $files := dict -}}
{{- if $v.existingSecret -}}
{{- with $v.caKey }}{{ $_ := set $files "ca_file" . }}{{ end -}}
{{- with $v.certKey }}{{ $_ := set $files "cert_file" . }}{{ end -}}
{{- with $v.keyKey }}{{ $_ := set $files "key_file" . }}{{ end -}}
{{- end -}}
{{- toJson $files -}}
{{- end -}}

{{/*
keyguard.yaml: `config` with the chart's tenancy (prefix, name, users_file) and upstream_auth
(user, password_file) merged in. Secrets stay in Secrets: the ConfigMap only names their files.
*/}}
{{- define "keyguard.config" -}}
{{- $c := deepCopy (.Values.config | default dict) -}}
{{- $t := deepCopy (get $c "tenancy" | default dict) -}}
{{- with .Values.tenancy.prefix }}{{ $_ := set $t "prefix" . }}{{ end -}}
{{- with .Values.tenancy.name }}{{ $_ := set $t "name" . }}{{ end -}}
{{- if include "keyguard.hasTenantsSecret" . }}{{ $_ := set $t "users_file" (include "keyguard.tenantsUsersFile" .) }}{{ end -}}
{{- if $t }}{{ $_ := set $c "tenancy" $t }}{{ end -}}
{{- if include "keyguard.hasUpstreamSecret" . -}}
{{- $a := dict "password_file" (include "keyguard.upstreamPasswordFile" .) -}}
{{- with .Values.upstreamAuth.username }}{{ $_ := set $a "user" . }}{{ end -}}
{{- $_ := set $c "upstream_auth" $a -}}
{{- end -}}
{{- if include "keyguard.hasSentinelSecret" . -}}
{{- $s := dict "password_file" (include "keyguard.sentinelPasswordFile" .) -}}
{{- with .Values.sentinel.username }}{{ $_ := set $s "user" . }}{{ end -}}
{{- $_ := set $c "sentinel" $s -}}
{{- end -}}
{{- $root := . -}}
{{- range $side := list "upstream" "listen" -}}
{{- $v := ternary $root.Values.upstreamTls $root.Values.listenTls (eq $side "upstream") -}}
{{- $field := printf "%s_tls" $side -}}
{{- $dir := include (printf "keyguard.%sTlsDir" $side) $root -}}
{{- $t := deepCopy (get $c $field | default dict) -}}
{{- range $f, $key := include "keyguard.tlsFiles" (list $side $root) | fromJson }}{{ $_ := set $t $f (printf "%s/%s" $dir $key) }}{{ end -}}
{{- with $v.minVersion }}{{ $_ := set $t "min_version" (toString .) }}{{ end -}}
{{- if and (eq $side "upstream") $v.serverName }}{{ $_ := set $t "server_name" $v.serverName }}{{ end -}}
{{- if and (eq $side "listen") $v.requireClientCert }}{{ $_ := set $t "require_client_cert" true }}{{ end -}}
{{- if $t }}{{ $_ := set $c $field $t }}{{ end -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}

{{/*
users.yaml of the chart-managed tenants Secret: tenancy.users with each password replaced by its
SHA-256, the only form keyguard keeps.
*/}}
{{- define "keyguard.tenantsUsersYaml" -}}
{{- $users := list -}}
{{- range $i, $u := .Values.tenancy.users -}}
{{- $sha := $u.password_sha256 | default "" -}}
{{- if and $u.password (not $sha) }}{{ $sha = sha256sum $u.password }}{{ end -}}
{{- if not $sha }}{{ fail (printf "tenancy.users[%d]: needs password or password_sha256" $i) }}{{ end -}}
{{- $out := dict "name" (required (printf "tenancy.users[%d].name is required" $i) $u.name)
    "password_sha256" $sha "prefix" (required (printf "tenancy.users[%d].prefix is required" $i) $u.prefix) -}}
{{- with $u.tenant }}{{ $_ := set $out "tenant" . }}{{ end -}}
{{- $users = append $users $out -}}
{{- end -}}
{{- toYaml (dict "users" $users) -}}
{{- end -}}

{{/*
tenancy and upstream_auth are read when keyguard starts (a reload changes only the key policy,
deny_commands and unknown_commands). Their values hashed, for a pod annotation that rolls the pods
when they change.
*/}}
{{- define "keyguard.restartChecksum" -}}
{{- $c := .Values.config | default dict -}}
{{- dict "tenancy" .Values.tenancy "upstreamAuth" .Values.upstreamAuth "config.tenancy" (get $c "tenancy")
    "config.upstream_auth" (get $c "upstream_auth") "upstreamTls" .Values.upstreamTls "sentinel" .Values.sentinel
    "listenTls" .Values.listenTls "config.upstream_tls" (get $c "upstream_tls") "config.listen_tls" (get $c "listen_tls")
    | toJson | sha256sum -}}
{{- end -}}

{{- define "keyguard.listenAddress" -}}
{{- .Values.listenAddress | default (ternary "127.0.0.1" "0.0.0.0" (eq .Values.mode "sidecar")) -}}
{{- end -}}

{{/*
NOTES.txt: how a client reaches keyguard's TLS listener at a host, with redis-cli. Called with
(list HOST .).
*/}}
{{- define "keyguard.notes.tlsClient" -}}
{{- $host := index . 0 }}{{ $v := (index . 1).Values }}{{ $l := $v.listenTls }}
  redis-cli --tls --cacert ca.crt -h {{ $host }} -p {{ $v.ports.redis }}{{ if $l.caKey }} --cert client.crt --key client.key{{ end }}
{{- if $l.requireClientCert }}
  A client certificate signed by the CA in Secret {{ $l.existingSecret }} ({{ $l.caKey }}) is required.
{{- else if $l.caKey }}
  A client certificate, when given, must be signed by the CA in Secret {{ $l.existingSecret }} ({{ $l.caKey }}).
{{- end }}
{{- end -}}

{{- define "keyguard.validate" -}}
{{- if not (has .Values.mode (list "standalone" "sidecar")) -}}
{{- fail (printf "mode: must be standalone or sidecar, not %q" .Values.mode) -}}
{{- end -}}
{{- if not .Values.upstream -}}
{{- fail "upstream: the Redis address (HOST:PORT, or a redis://, rediss://, redis-sentinel:// URL) is required" -}}
{{- end -}}
{{- $tls := or (hasPrefix "rediss://" .Values.upstream) (hasPrefix "rediss-sentinel://" .Values.upstream) -}}
{{- if and (not $tls) (or .Values.upstreamTls.existingSecret .Values.upstreamTls.serverName .Values.upstreamTls.minVersion) -}}
{{- fail (printf "upstreamTls: set, but upstream %q is not TLS (rediss:// or rediss-sentinel://)" .Values.upstream) -}}
{{- end -}}
{{- if and .Values.upstreamTls.existingSecret (ne (empty .Values.upstreamTls.certKey) (empty .Values.upstreamTls.keyKey)) -}}
{{- fail "upstreamTls.certKey and upstreamTls.keyKey go together (a client certificate needs its key)" -}}
{{- end -}}
{{- if and (or .Values.sentinel.username (include "keyguard.hasSentinelSecret" .)) (not (contains "-sentinel://" .Values.upstream)) -}}
{{- fail (printf "sentinel: set, but upstream %q is not a Sentinel group (redis-sentinel://)" .Values.upstream) -}}
{{- end -}}
{{- if and .Values.sentinel.username (not (include "keyguard.hasSentinelSecret" .)) -}}
{{- fail "sentinel.username: needs sentinel.password or sentinel.existingSecret" -}}
{{- end -}}
{{- if and .Values.listenTls.enabled (not .Values.listenTls.existingSecret) -}}
{{- fail "listenTls.existingSecret: required with listenTls.enabled (a Secret with keyguard's certificate and key)" -}}
{{- end -}}
{{- if and (not .Values.listenTls.enabled) (or .Values.listenTls.existingSecret .Values.listenTls.requireClientCert) -}}
{{- fail "listenTls: set, but listenTls.enabled is false" -}}
{{- end -}}
{{- if and .Values.listenTls.requireClientCert (not .Values.listenTls.caKey) -}}
{{- fail "listenTls.requireClientCert: needs listenTls.caKey (the CAs of client certificates)" -}}
{{- end -}}
{{- $c := .Values.config | default dict -}}
{{- if get (get $c "tenancy" | default dict) "users" -}}
{{- fail "config.tenancy.users: list users in tenancy.users or tenancy.existingSecret, which go into a Secret, not the ConfigMap" -}}
{{- end -}}
{{- if get $c "sentinel" -}}
{{- fail "config.sentinel: set sentinel.username and sentinel.password or existingSecret; the chart renders sentinel with the mounted password file" -}}
{{- end -}}
{{- if get $c "upstream_auth" -}}
{{- fail "config.upstream_auth: set upstreamAuth.username and upstreamAuth.password or existingSecret; the chart renders upstream_auth with the mounted password file" -}}
{{- end -}}
{{- if .Values.upstreamAuth.usernameKey -}}
{{- fail "upstreamAuth.usernameKey: keyguard takes its upstream user from upstreamAuth.username; the Secret holds only the password (upstreamAuth.passwordKey)" -}}
{{- end -}}
{{- if and .Values.upstreamAuth.username (not (include "keyguard.hasUpstreamSecret" .)) -}}
{{- fail "upstreamAuth.username: needs upstreamAuth.password or upstreamAuth.existingSecret" -}}
{{- end -}}
{{- if and .Values.tenancy.prefix (include "keyguard.hasTenantsSecret" .) -}}
{{- fail "tenancy.prefix: static tenancy and tenancy.users/existingSecret exclude each other: set one of them" -}}
{{- end -}}
{{- if and .Values.tenancy.name (not .Values.tenancy.prefix) -}}
{{- fail "tenancy.name: needs tenancy.prefix" -}}
{{- end -}}
{{- end -}}

{{/*
The keyguard container as one list item (starts with "- name:"), for a Deployment's containers
or, as a native sidecar, an app pod's initContainers. Config from the ConfigMap volume, the
upstream password and the tenants' users (when set) as files from their Secrets, probes on the
admin port.
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
      mountPath: {{ include "keyguard.upstreamPasswordFile" . | dir }}
      readOnly: true
    {{- end }}
    {{- if include "keyguard.hasTenantsSecret" . }}
    - name: keyguard-tenants
      mountPath: {{ include "keyguard.tenantsUsersFile" . | dir }}
      readOnly: true
    {{- end }}
    {{- if include "keyguard.hasSentinelSecret" . }}
    - name: keyguard-sentinel
      mountPath: {{ include "keyguard.sentinelPasswordFile" . | dir }}
      readOnly: true
    {{- end }}
    {{- if .Values.upstreamTls.existingSecret }}
    - name: keyguard-upstream-tls
      mountPath: {{ include "keyguard.upstreamTlsDir" . }}
      readOnly: true
    {{- end }}
    {{- if .Values.listenTls.enabled }}
    - name: keyguard-listen-tls
      mountPath: {{ include "keyguard.listenTlsDir" . }}
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
      - key: {{ .Values.upstreamAuth.passwordKey }}
        path: {{ include "keyguard.upstreamPasswordFile" . | base }}
{{- end }}
{{- if include "keyguard.hasTenantsSecret" . }}
- name: keyguard-tenants
  secret:
    secretName: {{ include "keyguard.tenantsSecretName" . }}
    items:
      - key: {{ .Values.tenancy.usersKey }}
        path: {{ include "keyguard.tenantsUsersFile" . | base }}
{{- end }}
{{- if include "keyguard.hasSentinelSecret" . }}
- name: keyguard-sentinel
  secret:
    secretName: {{ include "keyguard.sentinelSecretName" . }}
    items:
      - key: {{ .Values.sentinel.passwordKey }}
        path: {{ include "keyguard.sentinelPasswordFile" . | base }}
{{- end }}
{{- $root := . }}
{{- range $side := list "upstream" "listen" }}
{{- $v := ternary $root.Values.upstreamTls $root.Values.listenTls (eq $side "upstream") }}
{{- if $v.existingSecret }}
{{- /* Items without subPath: a rotated Secret reaches the files, and keyguard reloads them. */}}
- name: keyguard-{{ $side }}-tls
  secret:
    secretName: {{ $v.existingSecret }}
    items:
      {{- range $f, $key := include "keyguard.tlsFiles" (list $side $root) | fromJson }}
      - key: {{ $key }}
        path: {{ $key }}
      {{- end }}
{{- end }}
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

keyguard.sidecar is the container itself, for charts that place it themselves;
keyguard.sidecar.podAnnotations goes into the pod template's annotations.
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

{{/* Pod annotations for the app's pod template: roll the pods when tenancy or upstreamAuth change. */}}
{{- define "keyguard.sidecar.podAnnotations" -}}
checksum/keyguard: {{ include "keyguard.restartChecksum" . }}
{{- end -}}

{{- define "keyguard.sidecar.address" -}}
{{- printf "127.0.0.1:%v" .Values.ports.redis -}}
{{- end -}}
