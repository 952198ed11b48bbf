{{/*
Each component's settings: the chart's values as the real options of gpufleet and
JupyterHub ({Class: {option: value}} under "traitlets"), which files/gpufleet_config.py
applies. Rendered per component into the config Secret (config.yaml); each pod mounts its
own alone. No secret is in them: tokens reach the pods as environment variables, the
snapshot master key and the database password as files.
*/}}

{{/* A peer of a NetworkPolicy as gpufleet's options spell it ({cidr} or {pod_labels, ...}). */}}
{{- define "gpufleet.peer" -}}
{{- $spec := index . 0 -}}
{{- $default := index . 1 -}}
{{- $peer := dict -}}
{{- if $spec.cidr -}}
{{- $_ := set $peer "cidr" $spec.cidr -}}
{{- with $spec.exceptCIDRs }}{{ $_ := set $peer "except_cidrs" . }}{{ end -}}
{{- else if $spec.podLabels -}}
{{- $_ := set $peer "pod_labels" $spec.podLabels -}}
{{- with $spec.namespaceLabels }}{{ $_ := set $peer "namespace_labels" . }}{{ end -}}
{{- else -}}
{{- $peer = $default -}}
{{- end -}}
{{- with $spec.ports }}{{ $_ := set $peer "ports" . }}{{ end -}}
{{- toYaml $peer -}}
{{- end -}}

{{/*
Who session and job pods reach, and who reaches sessions: the release's pods by their
labels (in the release's namespace), unless networkPolicy.peers names them otherwise
(several clusters: what the other clusters' pods reach them as).
*/}}
{{- define "gpufleet.platformPeers" -}}
{{- $peers := .Values.networkPolicy.peers -}}
{{- $sameNamespace := eq (include "gpufleet.workloadNamespace" .) .Release.Namespace -}}
{{- $namespace := dict -}}
{{- if not $sameNamespace -}}
{{- /* Clusters before 1.21 lack this label: keep sessions in the release's namespace there. */ -}}
{{- $namespace = dict "kubernetes.io/metadata.name" .Release.Namespace -}}
{{- end -}}
{{- $result := dict -}}
{{- range $name, $port := dict "hub" 8081 "controller" 8003 "proxy" 0 -}}
{{- $default := dict "pod_labels" (include "gpufleet.selectorLabels" (list $ $name) | fromYaml) -}}
{{- if $namespace }}{{ $_ := set $default "namespace_labels" $namespace }}{{ end -}}
{{- if $port }}{{ $_ := set $default "ports" (list $port) }}{{ end -}}
{{- $_ := set $result $name (include "gpufleet.peer" (list (get $peers $name) $default) | fromYaml) -}}
{{- end -}}
{{- toYaml $result -}}
{{- end -}}

{{/* One cluster of c.FleetController.clusters from its values. */}}
{{- define "gpufleet.clusterEntry" -}}
{{- $spec := index . 0 -}}
{{- $entry := index . 1 -}}
{{- $_ := set $entry "name" $spec.name -}}
{{- range $key, $option := dict "gpuResource" "gpu_resource" "gpuNodeSelector" "gpu_node_selector" "gpuProductLabel" "gpu_product_label" "zoneLabel" "zone_label" "gpuTypeNames" "gpu_type_names" "podUrl" "pod_url" "context" "context" -}}
{{- with get $spec $key }}{{ $_ := set $entry $option . }}{{ end -}}
{{- end -}}
{{- if $spec.network -}}
{{- $network := dict -}}
{{- range $key, $option := dict "hub" "hub" "controller" "controller" "proxy" "proxy" "jobEgress" "job_egress" -}}
{{- with get $spec.network $key }}{{ $_ := set $network $option . }}{{ end -}}
{{- end -}}
{{- $_ := set $entry "network" $network -}}
{{- end -}}
{{- toYaml $entry -}}
{{- end -}}

{{/*
The fleet's clusters: this one through the pod's service account, the others through
their kubeconfig Secrets, mounted at /etc/gpufleet/kube/<name>/ (the hub mounts
hubKubeconfigSecret there where one is given).
*/}}
{{- define "gpufleet.clusters" -}}
{{- $local := dict "in_cluster" true "namespace" (include "gpufleet.workloadNamespace" .) -}}
{{- $clusters := list (include "gpufleet.clusterEntry" (list .Values.cluster $local) | fromYaml) -}}
{{- range .Values.remoteClusters -}}
{{- $remote := dict "kubeconfig" (printf "/etc/gpufleet/kube/%s/kubeconfig" .name) "namespace" (default "gpufleet" .namespace) -}}
{{- $clusters = append $clusters (include "gpufleet.clusterEntry" (list . $remote) | fromYaml) -}}
{{- end -}}
{{- toYaml $clusters -}}
{{- end -}}

{{/* Where snapshots go, as the controller and the agents read it (c.SnapshotSettings). */}}
{{- define "gpufleet.snapshotSettings" -}}
{{- $snapshots := .root.Values.snapshots -}}
store: {{ $snapshots.store | quote }}
key_file: {{ .keyFile | quote }}
{{- with $snapshots.s3.endpoint }}
s3_endpoint: {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "gpufleet.settings.hub" -}}
{{- $v := .Values -}}
{{- $peers := include "gpufleet.platformPeers" . | fromYaml -}}
{{- $proxyPeer := omit $peers.proxy "ports" -}}
{{- $hub := dict
  "hub_bind_url" "http://:8081"
  "hub_connect_url" (include "gpufleet.hubUrl" .)
  "bind_url" "http://:8000"
  "spawner_class" "gpufleet.spawner.kubernetes.KubeGPUSpawner"
  "upgrade_db" $v.hub.db.upgrade
  "db_url" (ternary "sqlite:////srv/gpufleet/data/jupyterhub.sqlite" $v.hub.db.url (eq $v.hub.db.type "sqlite-pvc"))
-}}
{{- with $v.hub.publicUrl }}{{ $_ := set $hub "public_url" . }}{{ end -}}
{{- $spawner := dict
  "controller_api_url" (printf "%s/services/gpufleet/api/v1" (include "gpufleet.controllerUrl" .))
  "image" (include "gpufleet.image" (list . $v.sessions.image))
  "image_pull_policy" $v.sessions.image.pullPolicy
  "session_priority_class" $v.priorityClasses.session.name
  "session_volumes" $v.sessions.volumes
  "snapshot_volumes" (ternary $v.sessions.snapshotVolumes (list) $v.snapshots.enabled)
  "snapshot_container_layer" (and $v.snapshots.enabled $v.sessions.snapshotContainerLayer)
  "environment" $v.sessions.environment
  "termination_grace_seconds" $v.sessions.terminationGraceSeconds
  "network_proxy" $proxyPeer
  "network_hub" $peers.hub
  "network_controller" $peers.controller
-}}
{{- $traitlets := dict
  "JupyterHub" $hub
  "ConfigurableHTTPProxy" (dict "should_start" false "api_url" (printf "http://%s:8001" (include "gpufleet.component" (list . "proxy-api"))))
  "KubeGPUSpawner" $spawner
  "FleetController" (dict "clusters" (include "gpufleet.clusters" . | fromYamlArray))
-}}
{{- $settings := dict
  "component" "hub"
  "hub" (dict "admin_users" $v.hub.adminUsers "groups" $v.hub.groups "controller_url" (include "gpufleet.controllerUrl" .))
  "traitlets" (mustMergeOverwrite $traitlets (deepCopy $v.hub.config))
-}}
{{- toYaml $settings -}}
{{- end -}}

{{/* Where job pods may go besides the hub, the controller and DNS: S3, their node's agent. */}}
{{- define "gpufleet.jobEgress" -}}
{{- $np := .Values.networkPolicy -}}
{{- $egress := list -}}
{{- range $np.s3.cidrs -}}
{{- $peer := dict "cidr" . "ports" $np.s3.ports -}}
{{- if eq . "0.0.0.0/0" }}{{ $_ := set $peer "except_cidrs" $np.s3.exceptCIDRs }}{{ end -}}
{{- $egress = append $egress $peer -}}
{{- end -}}
{{- if $np.s3.podLabels -}}
{{- $peer := dict "pod_labels" $np.s3.podLabels "ports" $np.s3.ports -}}
{{- with $np.s3.namespaceLabels }}{{ $_ := set $peer "namespace_labels" . }}{{ end -}}
{{- $egress = append $egress $peer -}}
{{- end -}}
{{- range $np.nodeCIDRs -}}
{{- $egress = append $egress (dict "cidr" . "ports" (list $.Values.agent.ports.progress)) -}}
{{- end -}}
{{- toYaml $egress -}}
{{- end -}}

{{- define "gpufleet.settings.controller" -}}
{{- $v := .Values -}}
{{- $peers := include "gpufleet.platformPeers" . | fromYaml -}}
{{- $fleet := dict
  "service_url" "http://0.0.0.0:8003"
  "data_dir" "/srv/gpufleet/data"
  "db_lease_seconds" $v.controller.leaseSeconds
  "clusters" (include "gpufleet.clusters" . | fromYamlArray)
  "sandbox_uids" $v.controller.sandboxUids
  "sandbox_uid_registry" ""
-}}
{{- /* sandbox_uid_registry "": the claim guards a machine that several deployments'
researchers share; here sessions and jobs are pods, and the controller's pod shares its
machine with no deployment's researchers. */ -}}
{{- if eq $v.controller.db.type "sqlite-pvc" -}}
{{- $_ := set $fleet "db_url" "sqlite:////srv/gpufleet/data/gpufleet.sqlite" -}}
{{- else -}}
{{- $_ := set $fleet "db_url" $v.controller.db.url -}}
{{- if $v.controller.db.passwordSecret.name }}{{ $_ := set $fleet "db_password_file" "/run/gpufleet/secrets/db-password" }}{{ end -}}
{{- end -}}
{{- range $key, $option := dict "projects" "projects" "profiles" "profiles" "priorityClasses" "priority_classes" -}}
{{- with get $v.controller $key }}{{ $_ := set $fleet $option . }}{{ end -}}
{{- end -}}
{{- with $v.jobs.checkpointStore }}{{ $_ := set $fleet "job_checkpoint_store" . }}{{ end -}}
{{- $jobs := dict
  "image" (include "gpufleet.image" (list . $v.sessions.image))
  "python" $v.jobs.python
  "priority_class" $v.priorityClasses.job.name
  "volumes" $v.jobs.volumes
  "memory_limit" $v.jobs.memoryLimit
  "cpu_limit" $v.jobs.cpuLimit
  "rendezvous_ports" $v.jobs.rendezvousPorts
  "progress_url" (printf "http://$(GPUFLEET_HOST_IP):%d/progress" (int $v.agent.ports.progress))
  "network_hub" $peers.hub
  "network_controller" $peers.controller
  "network_egress" (include "gpufleet.jobEgress" . | fromYamlArray)
-}}
{{- range $key, $option := dict "checkpointCredentialsSecret" "checkpoint_credentials_secret" "checkpointS3Endpoint" "checkpoint_s3_endpoint" "checkpointS3Region" "checkpoint_s3_region" -}}
{{- with get $v.jobs $key }}{{ $_ := set $jobs $option . }}{{ end -}}
{{- end -}}
{{- $traitlets := dict
  "FleetController" $fleet
  "KubeInventory" (dict "recycle_action" $v.controller.recycleAction)
  "KubeJobs" $jobs
-}}
{{- if $v.snapshots.enabled -}}
{{- $_ := set $traitlets "SnapshotSettings" (include "gpufleet.snapshotSettings" (dict "root" . "keyFile" "/run/gpufleet/secrets/snapshot-master-key") | fromYaml) -}}
{{- end -}}
{{- toYaml (dict "component" "controller" "traitlets" (mustMergeOverwrite $traitlets (deepCopy $v.controller.config))) -}}
{{- end -}}

{{- define "gpufleet.settings.agent" -}}
{{- $v := .Values -}}
{{- $agent := dict
  "controller_api_url" (include "gpufleet.controllerApiUrl" .)
  "nvml" $v.agent.nvml
  "cluster" $v.cluster.name
  "data_dir" "/var/lib/gpufleet/agent"
  "metrics_port" $v.agent.ports.metrics
  "progress_port" $v.agent.ports.progress
  "container_layer_roots" $v.agent.containerLayerRoots
  "pod_log_dirs" (list $v.agent.podLogDir)
  "network_guard" false
-}}
{{- /* network_guard false: the loopback guard (an nftables table, which would need
NET_ADMIN) protects the job ranks an agent runs as processes; on a Kubernetes node it runs
none (job pods are the cluster's), and the pods' NetworkPolicies do that work. */ -}}
{{- $traitlets := dict "NodeAgent" $agent -}}
{{- if $v.snapshots.enabled -}}
{{- $_ := set $traitlets "SnapshotSettings" (include "gpufleet.snapshotSettings" (dict "root" . "keyFile" "/etc/gpufleet/secrets/snapshot-master-key") | fromYaml) -}}
{{- end -}}
{{- toYaml (dict "component" "agent" "traitlets" (mustMergeOverwrite $traitlets (deepCopy $v.agent.config))) -}}
{{- end -}}
