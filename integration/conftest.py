"""On the build machine only the host-side runner (test_real_kernel.py) is collected here; the
guest suite runs inside the QEMU guest (run-suite.sh sets GUEST_RESULTS there)."""

import os

collect_ignore = [] if os.environ.get("GUEST_RESULTS") else ["guest_suite"]
