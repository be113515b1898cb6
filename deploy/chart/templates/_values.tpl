{{/*
The values every template reads, resolved once per rendering: what Istio's istio-cni chart does in
its zzz_profile.yaml and zzy_descope_legacy.yaml (istio/istio 86c9f01), written for this chart.

Precedence, last wins:
  1. the defaults (values.yaml's `_internal_defaults_do_not_set`);
  2. the `profile` (or `global.profile`), then the `compatibilityVersion`, then the `platform`
     (or `global.platform`): files/profile-*.yaml, each of which only changes defaults;
  3. what the user set (-f, --set);
  4. what the user set under `cni:` (an IstioOperator's `values.cni.*`), over the top-level keys.

Helm hands (1) and (3) together as .Values; keeping (1) under its own key is what lets (2) go
between them. Every template starts with `include "meshcap.values" .`: the first call replaces
.Values with the resolved values (templates share the one .Values map), later calls see the mark
and do nothing, so the order Helm renders templates in does not matter.
*/}}
{{- define "meshcap.values" -}}
{{- if not .Values._meshcapResolved -}}
{{- $user := omit .Values "_internal_defaults_do_not_set" -}}
{{- $resolved := deepCopy (index .Values "_internal_defaults_do_not_set") -}}
{{- $profile := dict -}}
{{- with coalesce $user.profile ($user.global).profile -}}
{{- $file := $.Files.Get (printf "files/profile-%s.yaml" .) -}}
{{- if not $file -}}
{{- fail (printf "profile %q: unknown (meshcap has Istio's: ambient, demo, preview, remote, stable)" .) -}}
{{- end -}}
{{- $profile = mustMergeOverwrite $profile (fromYaml $file) -}}
{{- end -}}
{{- with $user.compatibilityVersion -}}
{{- $file := $.Files.Get (printf "files/profile-compatibility-version-%v.yaml" .) -}}
{{- if not $file -}}
{{- fail (printf "compatibilityVersion %q: unknown (Istio's 1.25 to 1.30)" (toString .)) -}}
{{- end -}}
{{- $profile = mustMergeOverwrite $profile (fromYaml $file) -}}
{{- end -}}
{{- with coalesce $user.platform ($user.global).platform -}}
{{- $file := $.Files.Get (printf "files/profile-platform-%s.yaml" .) -}}
{{- if not $file -}}
{{- fail (printf "platform %q: unknown (Istio's: gke, k3d, k3s, microk8s, minikube, openshift)" .) -}}
{{- end -}}
{{- $profile = mustMergeOverwrite $profile (fromYaml $file) -}}
{{- end -}}
{{- $resolved = mustMergeOverwrite $resolved $profile (deepCopy $user) -}}
{{- with $user.cni -}}
{{- $resolved = mustMergeOverwrite $resolved (deepCopy .) -}}
{{- end -}}
{{- $_ := set $resolved "_meshcapResolved" true -}}
{{- $_ := set $ "Values" $resolved -}}
{{- end -}}
{{- end -}}
