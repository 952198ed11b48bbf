{{/*
The platform's generated secrets are made once and kept across upgrades, as
zero-to-jupyterhub keeps its own (_helpers-passwords.tpl): each is read back from the
Secret an earlier install of this release made, and generated only where there is none.

gpufleet.secretValue takes (dict "existing" <that Secret's data, or an empty dict> "key"
<its key> "generate" <a fresh value>) and gives the value, not yet base64-encoded. It
takes the existing data as an argument rather than calling `lookup` itself so that its
logic can be rendered with a given Secret (`helm template` has no cluster: its `lookup`
finds nothing).
*/}}
{{- define "gpufleet.secretValue" -}}
{{- $existing := .existing | default dict -}}
{{- if hasKey $existing .key -}}
{{- index $existing .key | b64dec -}}
{{- else -}}
{{- .generate -}}
{{- end -}}
{{- end -}}

{{/* A new token: 64 hex digits (JupyterHub's cookie secret must be hex). */}}
{{- define "gpufleet.newToken" -}}
{{- randAlphaNum 64 | sha256sum -}}
{{- end -}}

{{/* The keys of the platform's Secret and how each is made. */}}
{{- define "gpufleet.secretKeys" -}}
cookie-secret: token
proxy-token: token
controller-token: token
agent-token: token
spawner-token: token
snapshot-master-key: key
{{- end -}}
