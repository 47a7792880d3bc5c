{{- define "tinyloop.name" -}}{{ .Release.Name }}-tinyloop{{- end -}}
{{- define "tinyloop.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}
{{- define "tinyloop.labels" -}}
app.kubernetes.io/name: tinyloop
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
