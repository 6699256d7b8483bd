#!/usr/bin/env bash
# Build Helm from its Go module pinned in go.mod/go.sum here, for the chart's checks (unit tests:
# helm lint and helm template) and its installs on the local cluster. Test tooling only.
#
# Built once per (go.sum, Go version) into $RDMA_NETNS_HELM_CACHE (default
# /var/cache/rdma-netns-helm), outside the checkout; a second run only prints the binary's path.
#
#   build.sh               build (or find) and print the binary; waits for a build under way
#   build.sh --background  start the build niced in the background and return at once (the test
#                          command does this; the chart's tests wait for it)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$HERE"
CACHE_ROOT=${RDMA_NETNS_HELM_CACHE:-/var/cache/rdma-netns-helm}
VERSION=$(awk '$1 == "require" && $2 == "helm.sh/helm/v4" {print $3; exit}' go.mod)
[ -n "$VERSION" ] || { echo "helm/build.sh: no helm.sh/helm/v4 in go.mod" >&2; exit 1; }
KEY=$( (cat go.mod go.sum; go version 2>/dev/null) | sha256sum | cut -c1-12)
OUT=$CACHE_ROOT/$VERSION-$KEY
if [ ! -x "$OUT/helm" ] && [ "${1:-}" = --background ]; then
    mkdir -p "$CACHE_ROOT"
    nohup nice -n 10 "$HERE/build.sh" > "$CACHE_ROOT/build-$VERSION.log" 2>&1 < /dev/null &
    echo "helm/build.sh: building Helm $VERSION in the background (log: $CACHE_ROOT/build-$VERSION.log)" >&2
    exit 0
fi
if [ ! -x "$OUT/helm" ]; then
    command -v go >/dev/null || { echo "helm/build.sh: needs Go" >&2; exit 1; }
    mkdir -p "$CACHE_ROOT"
    exec 9> "$CACHE_ROOT/.build.lock"   # one build at a time; a second caller finds the first's
    flock 9
    if [ ! -x "$OUT/helm" ]; then
        tmp=$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")
        trap 'rm -rf "$tmp"' EXIT
        export GOCACHE=$tmp/gocache
        t0=$(date +%s)
        # What upstream's Makefile stamps, so `helm version` names the release.
        CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath \
            -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$VERSION" -o "$tmp/helm" helm.sh/helm/v4/cmd/helm
        rm -rf "$GOCACHE"
        chmod 755 "$tmp"
        rm -rf "$OUT"
        mv "$tmp" "$OUT"
        trap - EXIT
        echo "helm/build.sh: Helm $VERSION built in $(( $(date +%s) - t0 )) s into $OUT" >&2
    fi
fi
[ "${1:-}" = --background ] || echo "$OUT/helm"
