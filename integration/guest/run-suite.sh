#!/usr/bin/env bash
# Guest side of the real-kernel suite (run by integration/test_real_kernel.py through
# run-in-guest.sh --net-loop): the guest suite plus the netns suite's tests that need a kernel
# feature these build machines lack (ipvlan), with reports in $GUEST_RESULTS.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${GUEST_RESULTS:?run me through run-in-guest.sh}"
modprobe rdma_rxe
mkdir -p /var/run/netns
export PYTHONDONTWRITEBYTECODE=1
rc=0
.venv/bin/python -m pytest -p no:cacheprovider -q -rs integration/guest_suite \
    --junitxml="$GUEST_RESULTS/guest-suite.xml" || rc=$?
.venv/bin/python -m pytest -p no:cacheprovider -q -rs tests/netns/test_add_del.py -k ipvlan \
    --junitxml="$GUEST_RESULTS/netns-ipvlan.xml" || rc=$?
exit "$rc"
