#!/usr/bin/env bash
# The plain manifests in conf/k8s are the Helm chart (deploy/helm/rdma-netns) rendered with its
# default values: edit the chart, then run this. --check: exit 1 if a file differs from its render
# (tests/unit/test_helm_chart.py runs the same comparison).
#
#   rdma-netns-dp-daemonset.yaml   helm template (component=install; without the `helm test` pod)
#   rdma-netns-uninstall.yaml      helm template --set component=uninstall
#   rdma-check.yaml                the two-pod RDMA check of `helm test`, without the hook annotations
set -euo pipefail
cd "$(dirname "$0")/.."
HELM=$(integration/helm/build.sh)
CHART=deploy/helm/rdma-netns

render() {  # render COMPONENT: the chart's objects as a plain manifest
    echo "# Generated from $CHART by scripts/render-manifests.sh (helm template, default values): edit the chart."
    "$HELM" template rdma-netns "$CHART" --namespace kube-system --set "component=$1" --skip-tests | grep -v '^# Source: '
}

render_check() {  # the two-pod RDMA check (helm test with test.rdmaCheck.image) as a plain manifest
    echo "# Generated from $CHART by scripts/render-manifests.sh (templates/tests/rdma-check.yaml): edit the chart."
    "$HELM" template rdma-netns "$CHART" --set test.asHelmHooks=false \
        --set test.rdmaCheck.image=registry.example.com/ml/wdl-train:2024.06 \
        --show-only templates/tests/rdma-check.yaml | grep -v '^# Source: '
}

status=0
for pair in install:rdma-netns-dp-daemonset.yaml uninstall:rdma-netns-uninstall.yaml check:rdma-check.yaml; do
    component=${pair%%:*} file=conf/k8s/${pair#*:}
    if [ "$component" = check ]; then render=render_check; else render="render $component"; fi
    if [ "${1:-}" = --check ]; then
        if ! diff -u "$file" <($render) >&2; then
            echo "render-manifests: $file is not the chart's render: run scripts/render-manifests.sh" >&2
            status=1
        fi
    else
        $render > "$file.tmp" && mv "$file.tmp" "$file"
        echo "render-manifests: wrote $file"
    fi
done
exit $status
