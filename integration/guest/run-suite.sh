#!/usr/bin/env bash
# Guest side of the real-kernel suite (run by integration/test_real_kernel.py through
# run-in-guest.sh --net-loop): the guest suite plus the netns suite's tests that need a kernel
# feature these build machines lack (ipvlan), with reports in $GUEST_RESULTS.
#
#   run-suite.sh                 the kernel booted in its default (shared) mode: everything but
#                                test_5_exclusive_boot.py and test_8_exclusive_dra.py
#   run-suite.sh exclusive-boot  the kernel booted with ib_core.netns_mode=0: test_5 and test_8
#                                only (extra arguments go to pytest, e.g. -k)
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${GUEST_RESULTS:?run me through run-in-guest.sh}"
modprobe rdma_rxe
mkdir -p /var/run/netns
export PYTHONDONTWRITEBYTECODE=1
rc=0
if [ "${1:-}" = exclusive-boot ]; then
    shift
    .venv/bin/python -m pytest -p no:cacheprovider -q -rs -s integration/guest_suite/test_5_exclusive_boot.py \
        integration/guest_suite/test_8_exclusive_dra.py --junitxml="$GUEST_RESULTS/guest-exclusive-boot.xml" "$@" || rc=$?
    exit "$rc"
fi
.venv/bin/python -m pytest -p no:cacheprovider -q -rs integration/guest_suite \
    --ignore=integration/guest_suite/test_5_exclusive_boot.py \
    --ignore=integration/guest_suite/test_8_exclusive_dra.py \
    --junitxml="$GUEST_RESULTS/guest-suite.xml" || rc=$?
.venv/bin/python -m pytest -p no:cacheprovider -q -rs tests/netns/test_add_del.py -k ipvlan \
    --junitxml="$GUEST_RESULTS/netns-ipvlan.xml" || rc=$?
exit "$rc"
