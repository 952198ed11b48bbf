{{/* Names, labels and addresses every template shares. */}}

{{- define "gpufleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-gpufleet, or the release name alone where it already says gpufleet. */}}
{{- define "gpufleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "gpufleet.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* An object's name: (list $ "hub") -> <fullname>-hub. */}}
{{- define "gpufleet.component" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "gpufleet.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels of one component: (list $ "hub"). The component names are the chart's
own (hub, proxy, controller, agent, prometheus): never "session" or "job", which gpufleet
gives the pods it makes (app.kubernetes.io/managed-by: gpufleet).
*/}}
{{- define "gpufleet.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "gpufleet.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "gpufleet.labels" -}}
{{- $root := index . 0 -}}
{{ include "gpufleet.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels of the chart's objects that belong to no one component. */}}
{{- define "gpufleet.commonLabels" -}}
app.kubernetes.io/name: {{ include "gpufleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* An image reference: (list $ .Values.hub.image); an empty tag is the appVersion. */}}
{{- define "gpufleet.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* Where sessions and jobs run: cluster.namespace, else the release's. */}}
{{- define "gpufleet.workloadNamespace" -}}
{{- default .Release.Namespace .Values.cluster.namespace -}}
{{- end -}}

{{- define "gpufleet.hubUrl" -}}
{{- default (printf "http://%s.%s.svc:8081" (include "gpufleet.component" (list . "hub")) .Release.Namespace) .Values.hub.connectUrl -}}
{{- end -}}

{{- define "gpufleet.controllerUrl" -}}
{{- default (printf "http://%s.%s.svc:8003" (include "gpufleet.component" (list . "controller")) .Release.Namespace) .Values.controller.connectUrl | trimSuffix "/" -}}
{{- end -}}

{{/* The controller's API as agents reach it. */}}
{{- define "gpufleet.controllerApiUrl" -}}
{{- default (printf "%s/services/gpufleet/api/v1" (include "gpufleet.controllerUrl" .)) .Values.agent.controllerApiUrl -}}
{{- end -}}

{{- define "gpufleet.secretName" -}}
{{- default (include "gpufleet.component" (list . "secret")) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "gpufleet.platformPriorityClass" -}}
{{- default (include "gpufleet.component" (list . "platform")) .Values.priorityClasses.platform.name -}}
{{- end -}}

{{/*
The PodDisruptionBudget API: policy/v1 where the cluster serves it (1.21+), else
policy/v1beta1 (the test tier's 1.20). A live cluster answers the first test; offline
(`helm template`) Helm knows no kinds, so the Kubernetes version decides
(--kube-version).
*/}}
{{- define "gpufleet.pdbApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "policy/v1/PodDisruptionBudget" -}}
policy/v1
{{- else if semverCompare "<1.21-0" .Capabilities.KubeVersion.Version -}}
policy/v1beta1
{{- else -}}
policy/v1
{{- end -}}
{{- end -}}

{{/* Whether the Prometheus operator's CRDs exist (ServiceMonitor, PodMonitor, PrometheusRule). */}}
{{- define "gpufleet.hasMonitoringCRDs" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/*
A pod's security context for the platform's non-root processes: one uid of the image's
(helm/images), its group owning the pod's volumes.
*/}}
{{- define "gpufleet.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "gpufleet.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* nodeSelector, tolerations and imagePullSecrets of a pod: (list $ .Values.hub). */}}
{{- define "gpufleet.placement" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- with $component.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget of one component: (list $ "hub" .Values.hub.pdb). */}}
{{- define "gpufleet.pdb" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $pdb := index . 2 -}}
apiVersion: {{ include "gpufleet.pdbApiVersion" $root }}
kind: PodDisruptionBudget
metadata:
  name: {{ include "gpufleet.component" (list $root $name) }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "gpufleet.labels" (list $root $name) | nindent 4 }}
spec:
  maxUnavailable: {{ $pdb.maxUnavailable | int64 }}
  selector:
    matchLabels:
      {{- include "gpufleet.selectorLabels" (list $root $name) | nindent 6 }}
{{- end -}}

{{/* The S3 credentials' environment, where a Secret holds them. */}}
{{- define "gpufleet.s3Env" -}}
{{- $s3 := .Values.snapshots.s3 -}}
{{- if $s3.region }}
- name: AWS_DEFAULT_REGION
  value: {{ $s3.region | quote }}
- name: AWS_REGION
  value: {{ $s3.region | quote }}
{{- end }}
{{- if $s3.credentialsSecret.name }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $s3.credentialsSecret.name }}
      key: {{ $s3.credentialsSecret.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $s3.credentialsSecret.name }}
      key: {{ $s3.credentialsSecret.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{/* One key of the platform's Secret as an environment variable: (list $ "NAME" "key"). */}}
{{- define "gpufleet.secretEnv" -}}
{{- $root := index . 0 -}}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "gpufleet.secretName" $root }}
      key: {{ index . 2 }}
{{- end -}}

{{/*
The configuration volume of a platform pod: the chart's Python configuration file and
its own component's settings, at /etc/gpufleet/config/. (list $ "hub").
*/}}
{{- define "gpufleet.configVolume" -}}
{{- $root := index . 0 -}}
- name: config
  projected:
    sources:
      - configMap:
          name: {{ include "gpufleet.component" (list $root "config") }}
          items:
            - key: gpufleet_config.py
              path: gpufleet_config.py
      - secret:
          name: {{ include "gpufleet.component" (list $root "settings") }}
          items:
            - key: {{ index . 1 }}.yaml
              path: settings.yaml
{{- end -}}

{{- define "gpufleet.configEnv" -}}
- name: GPUFLEET_CONFIG
  value: /etc/gpufleet/config/gpufleet_config.py
- name: GPUFLEET_CHART_SETTINGS
  value: /etc/gpufleet/config/settings.yaml
{{- end -}}

{{/*
The other clusters' kubeconfig Secrets, one volume each, mounted at
/etc/gpufleet/kube/<name>/kubeconfig: (list $ "hub") takes hubKubeconfigSecret where one
is given, (list $ "controller") kubeconfigSecret.
*/}}
{{- define "gpufleet.kubeconfigVolumes" -}}
{{- $for := index . 1 -}}
{{- range $i, $cluster := (index . 0).Values.remoteClusters }}
{{- $secret := $cluster.kubeconfigSecret }}
{{- if and (eq $for "hub") (dig "hubKubeconfigSecret" "name" "" $cluster) }}
{{- $secret = $cluster.hubKubeconfigSecret }}
{{- end }}
- name: kube-{{ $i }}
  secret:
    secretName: {{ $secret.name }}
    defaultMode: 0440
    items:
      - key: {{ default "kubeconfig" $secret.key }}
        path: kubeconfig
{{- end }}
{{- end -}}

{{- define "gpufleet.kubeconfigMounts" -}}
{{- range $i, $cluster := .Values.remoteClusters }}
- name: kube-{{ $i }}
  mountPath: /etc/gpufleet/kube/{{ $cluster.name }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The volume of a component's own files: its PVC for SQLite, else a pod's own. (list $ "hub" .Values.hub.db). */}}
{{- define "gpufleet.dataVolume" -}}
{{- $root := index . 0 -}}
- name: data
{{- if eq (index . 2).type "sqlite-pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "gpufleet.component" (list $root (index . 1)) }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The PVC of a component's SQLite database: (list $ "hub" .Values.hub.db). */}}
{{- define "gpufleet.dataClaim" -}}
{{- $root := index . 0 -}}
{{- $db := index . 2 -}}
{{- if eq $db.type "sqlite-pvc" -}}
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {{ include "gpufleet.component" (list $root (index . 1)) }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "gpufleet.labels" (list $root (index . 1)) | nindent 4 }}
spec:
  accessModes: [ReadWriteOnce]
  {{- with $db.pvc.storageClassName }}
  storageClassName: {{ . }}
  {{- end }}
  resources:
    requests:
      storage: {{ $db.pvc.storage }}
{{- end -}}
{{- end -}}

{{- define "gpufleet.controllerMounts" -}}
- name: config
  mountPath: /etc/gpufleet/config
  readOnly: true
- name: data
  mountPath: /srv/gpufleet
- name: tmp
  mountPath: /tmp
{{- if or (and (eq .Values.controller.db.type "postgres") .Values.controller.db.passwordSecret.name) .Values.snapshots.enabled }}
- name: secrets
  mountPath: /run/gpufleet/secrets
  readOnly: true
{{- end }}
{{- include "gpufleet.kubeconfigMounts" . }}
{{- end -}}
