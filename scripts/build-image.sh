#!/usr/bin/env bash
# Build the DaemonSet's image (conf/k8s/rdma-netns-dp-daemonset.yaml) on this machine from Debian
# and PyPI packages only, no container registry: a Debian 12 root from mmdebstrap, the release
# folder /opt/rdma-netns-ds/<RELEASE>/ with its own Python and libraries (imagebuild/release.py),
# one layer, an OCI archive that `ctr -n k8s.io images import` and `podman load` take.
#
#   scripts/build-image.sh [--release R] [--name IMAGE] [--out FILE] [--test-hooks]
#
# --test-hooks makes a test build (the deploy suite's): its plugin honours the test-only environment
# variables (cni/rdma_netns/testhooks.py). Never for an image a node runs.
# RELEASE must differ for every build (the init container refuses two builds under one name):
# by default <version>-<commit>[-dirty-<hash of the changes>]. Prints a JSON summary last.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "build-image.sh: run as root (mmdebstrap, chroot)" >&2; exit 2; }

version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
release="$version-$(git rev-parse --short=10 HEAD 2>/dev/null || echo nogit)"
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  release="$release-dirty-$(git diff HEAD | sha256sum | cut -c1-8)"
fi
name=""
out=""
test_hooks=()
while [ $# -gt 0 ]; do
  case "$1" in
    --release) release=$2; shift 2 ;;
    --name) name=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --test-hooks) test_hooks=(--test-hooks); shift ;;
    *) echo "build-image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
name=${name:-localhost/rdma-netns/rdma-netns:$release}
out=${out:-dist/rdma-netns-$release.oci.tar}

missing=()
for pkg in mmdebstrap patchelf; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || scripts/setup.sh >/dev/null
exec .venv/bin/python -m imagebuild --release "$release" --name "$name" --out "$out" "${test_hooks[@]}"
