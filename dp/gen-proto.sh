#!/usr/bin/env bash
# Regenerate the protobuf/gRPC Python modules from the .proto files of both packages:
#   dp/rdma_netns_dp/api/         the daemon's own kubelet APIs (deviceplugin, pluginregistration, DRA, DRA health)
#   cni/rdma_netns/kubelet/api/   kubelet's PodResources API, below both packages (the CNI's kubelet
#                                 fallback and the device plugin both use it)
# Each .proto is compiled from its package's root (-I dp, -I cni), so the generated import lines
# name the package it lives in. The generated *_pb2*.py files are committed (the node needs no
# protoc); tests/unit/dp/test_api.py fails when they drift from the .proto files.
# Usage: dp/gen-proto.sh [ROOT]   (ROOT holds dp/ and cni/; default: this repository, i.e. in place)
set -euo pipefail
root=$(cd "${1:-$(dirname "$0")/..}" && pwd)
PY=${PYTHON:-$root/.venv/bin/python}
gen() {  # gen PACKAGE_ROOT PROTO...
  local src=$1; shift
  for proto in "$@"; do
    (cd "$root/$src" && "$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. "$proto")
  done
}
gen dp rdma_netns_dp/api/deviceplugin/v1beta1/api.proto rdma_netns_dp/api/pluginregistration/v1/api.proto \
  rdma_netns_dp/api/dra/v1/api.proto rdma_netns_dp/api/drahealth/v1/api.proto
gen cni rdma_netns/kubelet/api/podresources/v1/api.proto
