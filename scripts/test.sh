#!/usr/bin/env bash
# Run every test: unit tests, and the netns suite (real network namespaces, veth rails, Debian's
# host-local IPAM) against the installed rdma-netns executable. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs "$@"
