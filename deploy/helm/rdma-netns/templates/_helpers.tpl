{{/* The DaemonSet's name: rdma-netns-dp, or rdma-netns-dp-<pool> for a node pool's release. */}}
{{- define "rdma-netns.name" -}}
{{- if .Values.pool -}}rdma-netns-dp-{{ .Values.pool }}{{- else -}}rdma-netns-dp{{- end -}}
{{- end -}}

{{- define "rdma-netns.uninstallName" -}}
{{- if .Values.pool -}}rdma-netns-uninstall-{{ .Values.pool }}{{- else -}}rdma-netns-uninstall{{- end -}}
{{- end -}}

{{- define "rdma-netns.configName" -}}{{ include "rdma-netns.name" . }}-config{{- end -}}

{{/* The image, by digest when one is given. */}}
{{- define "rdma-netns.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- end -}}

{{/* Labels that select a release's pods (name, and the pool when there is one). */}}
{{- define "rdma-netns.selector" -}}
app.kubernetes.io/name: {{ .name }}
{{- if .pool }}
rdma-netns.io/pool: {{ .pool }}
{{- end }}
{{- end -}}

{{- define "rdma-netns.nodeSelector" -}}
{{- $selector := deepCopy .Values.nodeSelector -}}
{{- if .Values.pool }}{{- $_ := set $selector "rdma-netns.io/pool" .Values.pool -}}{{- end -}}
{{- toYaml $selector -}}
{{- end -}}

{{/* The pods' routes over the rails: the given ones, or one route to the fabric prefix. */}}
{{- define "rdma-netns.routes" -}}
{{- if .Values.fabric.routes -}}{{ toJson .Values.fabric.routes }}{{- else -}}[{"dst": {{ .Values.fabric.prefix | quote }}}]{{- end -}}
{{- end -}}

{{/* The rails as a JSON list, one rail a line at the given indent. */}}
{{- define "rdma-netns.rails" -}}
{{- $indent := .indent -}}
{{- $n := len .rails -}}
{{- range $i, $rail := .rails }}
{{ $indent }}{{ include "rdma-netns.railJson" $rail }}{{ if lt (add1 $i) $n }},{{ end }}
{{- end }}
{{- end -}}

{{/* A rail as JSON, netdev and ifname first (the order of the docs' examples), then its other keys. */}}
{{- define "rdma-netns.railJson" -}}
{{- $first := list -}}
{{- range $k := list "netdev" "ifname" -}}
{{- if hasKey $ $k }}{{ $first = append $first (printf "%q: %s" $k (toJson (get $ $k))) }}{{ end -}}
{{- end -}}
{{- range $k, $v := omit . "netdev" "ifname" }}{{ $first = append $first (printf "%q: %s" $k (toJson $v)) }}{{ end -}}
{{ printf "{%s}" (join ", " $first) }}
{{- end -}}

{{/* The release without a pool stays off nodes of a named pool (they run their pool's release). */}}
{{- define "rdma-netns.affinity" -}}
{{- if not .Values.pool -}}
affinity:
  # A node labelled rdma-netns.io/pool=<name> runs that pool's release (values: pool), not this one.
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - {key: rdma-netns.io/pool, operator: DoesNotExist}
{{- end -}}
{{- end -}}

{{/* An exec probe that reads a file a daemon of the pod keeps (rdma_netns/util/probe_file.py) with the
shell: no Python start-up each period (on a loaded node a timed-out exec probe keeps running and
they pile up). It fails when the file is missing or older than maxAge seconds (its writer is stuck
or gone) and, with ready, unless its first line is "ready" (it prints the file: kubectl describe
shows why). skipUnless: a shell condition under which the probe passes without looking. */}}
{{- define "rdma-netns.fileProbe" -}}
exec:
  command:
    - /bin/sh
    - -c
    - >-
{{- if .skipUnless }}
      if ! {{ .skipUnless }}; then exit 0; fi;
{{- end }}
      f={{ .file }};
      [ -e "$f" ] || { echo "$f: not written yet"; exit 1; };
      age=$(( $(date +%s) - $(stat -c %Y "$f") ));
      [ "$age" -le {{ .maxAge }} ] || { echo "$f: not rewritten for $age s (its writer is stuck or gone)"; exit 1; };
{{- if .ready }}
      IFS= read -r first < "$f"; [ "$first" = ready ] || { cat "$f"; exit 1; };
{{- end }}
      exit 0
{{- end -}}

{{/* The pod interface names of the rails (rdma<i> where a rail names none), space-separated. */}}
{{- define "rdma-netns.testIfnames" -}}
{{- $names := list -}}
{{- range $i, $rail := .Values.rails -}}
{{- $names = append $names (default (printf "rdma%d" $i) $rail.ifname) -}}
{{- end -}}
{{- join " " $names -}}
{{- end -}}

{{/* "true" when the sidecar checks containerd's CDI setting: a folder given, and CDI in use. */}}
{{- define "rdma-netns.checkCdi" -}}
{{- if and .Values.runtime.containerdConfigDir .Values.devicePlugin.podCdi .Values.rdmaForNonHostNetworkPods -}}true{{- end -}}
{{- end -}}
