{{/* The kpr image, as the kustomization's `images` entry sets it. */}}
{{- define "kpr.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* mapSizes as --map-sizes wants them: key=value,... in key order. */}}
{{- define "kpr.mapSizes" -}}
{{- $pairs := list -}}
{{- range $key, $value := . -}}
{{- $pairs = append $pairs (printf "%s=%v" $key (int64 $value)) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
