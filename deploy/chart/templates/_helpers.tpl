{{/* The DaemonSet's name: meshcap-cni recognises its own agent's pods by it (with a dash). */}}
{{- define "meshcap.name" -}}
meshcap-agent
{{- end -}}

{{/* Labels of every object (as Istio's chart labels its own, with meshcap's names). */}}
{{- define "meshcap.labels" -}}
app.kubernetes.io/name: {{ include "meshcap.name" . }}
app.kubernetes.io/part-of: meshcap
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
istio.io/rev: {{ .Values.revision | default "default" | quote }}
install.operator.istio.io/owning-resource: {{ .Values.ownerName | default "unknown" | quote }}
{{- end -}}

{{/* Whether cluster-scoped, or namespaced, objects are rendered (Istio's global.resourceScope). */}}
{{- define "meshcap.clusterScope" -}}
{{- if has .Values.global.resourceScope (list "all" "cluster") }}true{{ end -}}
{{- end -}}
{{- define "meshcap.namespaceScope" -}}
{{- if has .Values.global.resourceScope (list "all" "namespace") }}true{{ end -}}
{{- end -}}

{{/*
The CNI bin dir: `cniBinDir`, or, when it is empty (the gke platform empties it), found from the
server's version as Istio's chart does (templates/daemonset.yaml at 86c9f01): GKE's versions
contain "-gke" and its runtime reads /home/kubernetes/bin.
*/}}
{{- define "meshcap.cniBinDir" -}}
{{- if .Values.cniBinDir -}}
{{ .Values.cniBinDir }}
{{- else if contains "-gke" .Capabilities.KubeVersion.GitVersion -}}
/home/kubernetes/bin
{{- else -}}
/opt/cni/bin
{{- end -}}
{{- end -}}

{{/* The agent's image, composed as Istio's chart composes its node agent's. */}}
{{- define "meshcap.image" -}}
{{- if contains "/" .Values.image -}}
{{ .Values.image }}
{{- else -}}
{{- $tag := toString (.Values.tag | default .Values.global.tag | default .Chart.AppVersion) -}}
{{- $variant := .Values.variant | default .Values.global.variant -}}
{{ .Values.hub | default .Values.global.hub }}/{{ .Values.image | default "meshcap" }}:{{ $tag }}{{ with $variant }}-{{ . }}{{ end }}
{{- end -}}
{{- end -}}

{{/* The log level the agent gets: Istio's `logging.level`, else `global.logging.level`. */}}
{{- define "meshcap.logLevel" -}}
{{ coalesce .Values.logging.level (.Values.global.logging).level "info" }}
{{- end -}}

{{/* The repair mode that acts, as Istio's chart and agent pick it: the first set. */}}
{{- define "meshcap.repairMode" -}}
{{- if .Values.repair.enabled -}}
{{- if .Values.repair.repairPods }}repair{{ else if .Values.repair.deletePods }}delete{{ else if .Values.repair.labelPods }}label{{ end -}}
{{- end -}}
{{- end -}}

{{/* Whether the platform is OpenShift (its SecurityContextConstraints). */}}
{{- define "meshcap.openshift" -}}
{{- if eq (coalesce .Values.platform (.Values.global).platform "" | toString) "openshift" }}true{{ end -}}
{{- end -}}
