#!/bin/bash
# Proves the NETLINK_RDMA clients (cni/rdma_netns/kernel/rdma_netlink.py on pyroute2 and
# rdma_nldev.py on the standard library) against the real kernel RDMA core: Soft-RoCE devices
# made with link_add, devices/ports/char devices compared with `rdma` and sysfs, the netns mode
# switch (and EBUSY naming the namespaces), moving a device into a pod netns and back, and the
# errno of each refusal.
#
# On the host it boots the guest and runs itself there:
#   integration/guest/check-rdma-netlink.sh          # = run-in-guest.sh --timeout 900 -- <this>
# In the guest (it changes the system-wide RDMA netns mode) it runs check_rdma_netlink.py once
# (one Python process: `import pyroute2` takes 10-30 s under software emulation).
#
# Prints "CHECK <name>: PASS|FAIL ..." lines and a final count; exits non-zero on any failure.
# Env: RDMA_NETNS_PYTHON (default: the repo's .venv/bin/python).
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

if [ -z "${GUEST_RESULTS:-}" ] && [ "$(hostname)" != virtme-ng ]; then
    exec "$HERE/run-in-guest.sh" --timeout 900 -- "$HERE/check-rdma-netlink.sh" "$@"
fi
exec 2>&1

PY=${RDMA_NETNS_PYTHON:-$REPO/.venv/bin/python}
echo "== kernel $(uname -r), $(nproc) cpu(s), python $PY"
modprobe rdma_rxe || { echo "CHECK modprobe-rdma_rxe: FAIL"; exit 1; }
echo "CHECK modprobe-rdma_rxe: PASS"

t0=$EPOCHREALTIME
# the source tree, not the installed package: this checks the code as it is in the checkout
PYTHONPATH=$REPO/cni "$PY" "$HERE/check_rdma_netlink.py"
rc=$?
echo "check-rdma-netlink: python ran $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')s, exit $rc"
exit $rc
