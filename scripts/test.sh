#!/usr/bin/env bash
# Run every test: unit tests, the netns suite (real network namespaces, veth rails, Debian's
# host-local IPAM) and the real-kernel suite (a Debian 7.x kernel under QEMU with Soft-RoCE),
# all against the installed rdma-netns executable. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
integration/guest/fetch-kernel.sh >/dev/null  # idempotent; cached after the first run
# A test that leaves files in the machine's own CNI/CDI folders fails (tests/conftest.py).
RDMA_NETNS_CHECK_LEAKS=1 exec .venv/bin/python -m pytest -q -rs "$@"
