"""A cluster whose run was killed (a CI job stopped mid-suite) must not stop the next one: `up`
takes down a cluster whose network namespace has nothing running inside, and refuses one that
still runs. Runs before the other modules of this folder (no cluster is up meanwhile)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from integration.cluster import namespaces
from integration.cluster.cluster import leftovers, reclaim_abandoned
from integration.cluster.layout import Layout

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")


@pytest.fixture
def abandoned():
    """What a killed run leaves: its folder, the fixed-name network namespace it made (with its
    bridge), no process."""
    layout = Layout(Path(tempfile.mkdtemp(prefix="rk8s-", dir="/tmp")))
    if layout.netns_path.exists():
        pytest.fail(f"{layout.netns_path} exists before the test: a cluster is up or was abandoned")
    namespaces.make_network(layout)
    yield layout
    namespaces.run("ip", "netns", "delete", layout.netns_path.name, check=False)
    subprocess.run(["rm", "-rf", str(layout.root)], check=False)


def test_an_abandoned_cluster_is_taken_down_before_a_new_one(abandoned):
    reclaim_abandoned(Layout(Path("/tmp/rk8s-the-next-run")))
    assert leftovers(abandoned) == []


def test_a_cluster_with_a_live_process_is_refused(abandoned):
    sleeper = subprocess.Popen(["ip", "netns", "exec", abandoned.netns_path.name, "sleep", "60"])
    try:
        for _ in range(50):
            if namespaces.processes_in_netns(abandoned.netns_path):
                break
            subprocess.run(["sleep", "0.1"])
        with pytest.raises(RuntimeError, match="exists already with processes"):
            reclaim_abandoned(Layout(Path("/tmp/rk8s-the-next-run")))
        assert abandoned.netns_path.exists() and abandoned.root.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
