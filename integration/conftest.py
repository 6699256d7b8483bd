"""On the build machine only the host-side runner (test_real_kernel.py) is collected here; the
guest suite runs inside the QEMU guest (run-suite.sh sets GUEST_RESULTS there)."""

import os

from tests.conftest import enable_test_hooks

collect_ignore = [] if os.environ.get("GUEST_RESULTS") else ["guest_suite"]

# Lines the real-kernel runner wants shown at the end of the run (boot time, per-call times).
GUEST_REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if GUEST_REPORT:
        terminalreporter.section("real-kernel guest")
        for line in GUEST_REPORT:
            terminalreporter.write_line(line)


def pytest_configure(config):
    enable_test_hooks()  # the suites run the test venv's plugin with test-only variables (testhooks.py)


def pytest_collection_modifyitems(items):
    """The real-cluster suite last: the test command builds its Kubernetes in the background while
    the other suites run (integration/kube/build.sh --background)."""
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)
