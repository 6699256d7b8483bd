#!/usr/bin/env bash
# Regenerate the protobuf/gRPC Python modules from the .proto files under
# dp/rdma_netns_dp/api/. The generated *_pb2*.py files are committed (the node needs no protoc);
# tests/unit/dp/test_api.py fails when they drift from the .proto files.
# Usage: dp/gen-proto.sh [OUTPUT_ROOT]   (default: dp, i.e. in place)
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-.}
PY=${PYTHON:-../.venv/bin/python}
for proto in rdma_netns_dp/api/deviceplugin/v1beta1/api.proto rdma_netns_dp/api/pluginregistration/v1/api.proto \
             rdma_netns_dp/api/podresources/v1/api.proto; do
  mkdir -p "$out/$(dirname "$proto")"
  "$PY" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$proto"
done
