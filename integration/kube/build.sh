#!/usr/bin/env bash
# Build the real Kubernetes components the local cluster runs (scripts/cluster.sh), from upstream's
# Go modules pinned in go.mod/go.sum here: kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet and kubectl of one release, and etcd. Test tooling only: nothing here is shipped.
#
# Built once per (release, go.sum, recipe) into $RDMA_NETNS_KUBE_CACHE (default
# /var/cache/rdma-netns-kube), outside the checkout; a second run only prints the folder. Prints the
# bin folder on stdout.
#
#   build.sh               build (or find) and print the folder; waits for a build under way
#   build.sh --background  start the build niced in the background and return at once (the test
#                          command does this, so the build uses what the first suites leave idle)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$HERE"
CACHE_ROOT=${RDMA_NETNS_KUBE_CACHE:-/var/cache/rdma-netns-kube}
RELEASE=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' go.mod)
[ -n "$RELEASE" ] || { echo "kube/build.sh: no k8s.io/kubernetes in go.mod" >&2; exit 1; }
# Bump RECIPE when the way of building below changes (flags, the list of programs).
RECIPE=1
KEY=$( (cat go.mod go.sum; echo "recipe=$RECIPE"; go version 2>/dev/null) | sha256sum | cut -c1-12)
OUT=$CACHE_ROOT/$RELEASE-$KEY
if [ -e "$OUT/bin/.complete" ]; then
    [ "${1:-}" = --background ] || echo "$OUT/bin"
    exit 0
fi
mkdir -p "$CACHE_ROOT"
if [ "${1:-}" = --background ]; then
    nohup nice -n 10 "$HERE/build.sh" > "$CACHE_ROOT/build-$RELEASE.log" 2>&1 < /dev/null &
    echo "kube/build.sh: building Kubernetes $RELEASE in the background (log: $CACHE_ROOT/build-$RELEASE.log)" >&2
    exit 0
fi
# One build at a time: a second caller waits here, then finds the first one's result.
exec 9> "$CACHE_ROOT/.build.lock"
flock 9
if [ -e "$OUT/bin/.complete" ]; then
    echo "$OUT/bin"
    exit 0
fi
command -v go >/dev/null || { echo "kube/build.sh: needs Go (go.mod: $(awk '$1 == "go" {print $2}' go.mod))" >&2; exit 1; }

major=${RELEASE#v}; major=${major%%.*}
minor=${RELEASE#v*.}; minor=${minor%%.*}
# What upstream's release build stamps (hack/lib/version.sh): kubectl version, the node's
# kubeletVersion and the API server's /version read these.
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$RELEASE -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$RELEASE"

tmp=$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
# Go's build cache of this build (about 4 GB) goes with it: the binaries are what is kept.
export GOCACHE=$tmp/gocache
t0=$(date +%s)
echo "kube/build.sh: building Kubernetes $RELEASE and etcd into $OUT (first time: 10-30 minutes on 2 cores)" >&2
# CGO off, as upstream builds its server binaries: static, no libc skew with the guests.
CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "$ldflags" -o "$tmp/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kubectl
CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" -o "$tmp/bin/etcd" go.etcd.io/etcd/server/v3
echo "built in $(( $(date +%s) - t0 )) s with $(go version)" > "$tmp/bin/.complete"
rm -rf "$GOCACHE"
rm -rf "$OUT"
mv "$tmp" "$OUT"
trap - EXIT
echo "kube/build.sh: done in $(( $(date +%s) - t0 )) s; $(du -sh "$OUT/bin" | cut -f1) in $OUT/bin" >&2
echo "$OUT/bin"
