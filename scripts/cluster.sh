#!/usr/bin/env bash
# A real Kubernetes on this machine, built from upstream's Go modules (integration/kube/build.sh):
# etcd, kube-apiserver (TLS, service accounts, RBAC, NodeRestriction and Pod Security on),
# kube-controller-manager, kube-scheduler, and this machine as a node (containerd 1.7 with CDI on,
# kubelet, a bridge as the primary CNI), all inside one network namespace and one mount namespace
# of its own, files under $RDMA_NETNS_CLUSTER_DIR (default /tmp/rdma-netns-cluster).
#
#   scripts/cluster.sh up        # start it (the first run builds Kubernetes: see docs/testing.md)
#   scripts/cluster.sh status    # what runs, and the nodes
#   scripts/cluster.sh kubectl get nodes
#   scripts/cluster.sh down      # stop it; nothing is left behind
#
# Needs root and scripts/setup.sh's packages (setup.sh runs first when the .venv is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "cluster.sh: run as root (namespaces, mounts, a kubelet)" >&2; exit 2; }
[ -x .venv/bin/python ] || scripts/setup.sh >&2
exec .venv/bin/python -m integration.cluster "$@"
