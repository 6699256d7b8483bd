#!/usr/bin/env bash
# Run every test: unit tests, the netns suite (real network namespaces, veth rails, Debian's
# host-local IPAM) and the real-kernel suite (a Debian 7.x kernel under QEMU with Soft-RoCE),
# all against the installed rdma-netns executable, and a real Kubernetes (scripts/cluster.sh) with
# the DaemonSet as written. Needs root and Go (Kubernetes is built from its Go modules).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
integration/guest/fetch-kernel.sh >/dev/null  # idempotent; cached after the first run
# The real cluster's Kubernetes, built once per release (about 11 minutes of 2 cores): started now in
# the background, niced, so that it uses what the first suites leave idle; the cluster suite runs last.
integration/kube/build.sh --background
# Helm for the chart's tests (deploy/helm), from its Go module: about 4.5 minutes the first time, in
# the background like Kubernetes (the chart's tests wait for it), cached.
integration/helm/build.sh --background
# A test that leaves files in the machine's own CNI/CDI folders fails (tests/conftest.py).
RDMA_NETNS_CHECK_LEAKS=1 exec .venv/bin/python -m pytest -q -rs "$@"
