"""Fixtures for the containerd CRI suite: one private containerd per test module (rig.py), a fresh
conflist per test, and the figures the suite measured, shown at the end of the run."""

from __future__ import annotations

import os
import statistics

import pytest

from integration.cri.rig import CONTAINERD_16, CONTAINERD_17, Containerd, ContainerdRig, missing_tools
from tests.conftest import installed_executable

# kind -> RunPodSandbox wall times (s); "burst16" -> wall time of 16 concurrent sandboxes.
TIMINGS: dict[str, list[float]] = {}
REPORT: list[str] = []


def record(kind: str, seconds: float) -> None:
    TIMINGS.setdefault(kind, []).append(seconds)


def need_containerd(containerd: Containerd = CONTAINERD_16) -> None:
    """Skip where the suite cannot run, but fail under CI=true: CI must provide root and the
    Debian packages (scripts/setup.sh installs them, and containerd 1.7)."""
    why = None
    if os.geteuid() != 0:
        why = "needs root (containerd, runc, veth rails and bridges in the root netns)"
    else:
        missing = missing_tools(containerd)
        if missing:
            why = f"needs {', '.join(missing)} (scripts/setup.sh installs them)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the containerd CRI suite {why}; CI must provide it")
        pytest.skip(why)


@pytest.fixture(scope="module", params=[CONTAINERD_16, CONTAINERD_17], ids=lambda c: f"containerd-{c.label}")
def rig(request):
    """A private containerd per module and version: Debian 12's 1.6 and Debian 13's 1.7."""
    need_containerd(request.param)
    r = ContainerdRig(installed_executable(), containerd=request.param)
    try:
        r.start()
        REPORT.append(f"containerd {r.cri.version().runtime_version} (CRI {r.cri.version().runtime_api_version}), "
                      f"pause image {r.image.name} ({'cached' if r.image.cached else 'built'}: {r.image.tarball})")
        yield r
    finally:
        r.close()
        remnants = r.remnants()
        assert not remnants, f"the rig left {remnants}"


def pytest_terminal_summary(terminalreporter):
    if not (TIMINGS or REPORT):
        return
    terminalreporter.section("containerd CRI with rdma-netns")
    for line in REPORT:
        terminalreporter.write_line(line)
    for kind, values in sorted(TIMINGS.items()):
        terminalreporter.write_line(f"{kind}: median {statistics.median(values) * 1000:.0f} ms over {len(values)} "
                                    f"(min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f})")
