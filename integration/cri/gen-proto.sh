#!/usr/bin/env bash
# Regenerate the CRI v1 client (integration/cri/api/runtime/v1/api_pb2*.py) with the venv's grpc_tools.
#
# The .proto is kubernetes/cri-api's pkg/apis/runtime/v1/api.proto at tag v0.25.0 (commit
# ad0a88625fcaf5a4400ffcb483a88f0771d5a95c, the cri-api line containerd 1.6 is built against) with
# the gogoproto import and options removed (they only steer Go code generation; field numbers and
# types are untouched). Only the test rig uses it; the node never needs it.
#
# Usage: integration/cri/gen-proto.sh [UPSTREAM_API_PROTO]
#   with an argument: strip that upstream file into api/runtime/v1/api.proto first, then compile;
#   without: compile the committed api/runtime/v1/api.proto.
# OUT=<dir> writes the generated modules under <dir> instead of in place (the drift test uses it).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
proto=integration/cri/api/runtime/v1/api.proto
PY=${PYTHON:-$repo/.venv/bin/python}
if [ $# -ge 1 ]; then
  {
    echo "// kubernetes/cri-api pkg/apis/runtime/v1/api.proto (tag v0.25.0), gogoproto import and options"
    echo "// removed by integration/cri/gen-proto.sh. Generated Python beside it: api_pb2*.py."
    sed -e '/^import "github.com\/gogo\/protobuf\/gogoproto\/gogo.proto";/d' \
        -e '/^option (gogoproto\./d' \
        -e 's/ *\[(gogoproto\.[^]]*\]//g' "$1"
  } > "$repo/$proto"
fi
if grep -q "gogo.proto\|(gogoproto" "$repo/$proto"; then
  echo "gen-proto.sh: gogoproto still referenced in $proto" >&2
  exit 1
fi
cd "$repo"
# Module paths follow the file path from the repo root (integration.cri.api.runtime.v1.api_pb2),
# so the generated grpc module imports its messages by that package path.
out=${OUT:-.}
"$PY" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$proto"
