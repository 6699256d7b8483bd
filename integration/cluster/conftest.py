"""Fixtures of the real-cluster suite: the local cluster (scripts/cluster.sh's, up once for the
module and down after it, leaving nothing), and the release image built by scripts/build-image.sh,
imported into the node's containerd and pinned by digest as docs/install.md says."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration.cluster.cluster import Cluster, leftovers
from integration.cluster.layout import REPO, Layout
from integration.cri.rig import CONTAINERD_17, missing_tools

REPORT: list[str] = []


@dataclass(frozen=True)
class ReleaseImage:
    name: str
    pinned: str
    digest: str
    archive: Path


def _need_root_and_tools() -> None:
    why = None
    if os.geteuid() != 0:
        why = "needs root"
    elif missing_tools(CONTAINERD_17):
        why = f"needs {', '.join(missing_tools(CONTAINERD_17))} (scripts/setup.sh)"
    elif subprocess.run(["sh", "-c", "command -v go"], capture_output=True).returncode != 0:
        why = "needs Go (integration/kube/build.sh builds Kubernetes from its modules)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the real-cluster suite {why}; CI must provide it")
        pytest.skip(why)


@pytest.fixture(scope="module")
def cluster():
    _need_root_and_tools()
    layout = Layout(Path(tempfile.mkdtemp(prefix="rk8s-", dir="/tmp")))
    c = Cluster(layout)
    try:
        c.up()
        yield c
    finally:
        c.down()
        left = leftovers(layout)
        assert not left, f"scripts/cluster.sh down left {left}"


@pytest.fixture(scope="module")
def release_image(cluster, tmp_path_factory) -> ReleaseImage:
    """A release image as an admin builds it (no test hooks), in the node's containerd by digest."""
    out = tmp_path_factory.mktemp("image")
    commit = subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "nogit"
    release = f"cluster-{commit}-{os.urandom(2).hex()}"
    proc = subprocess.run([str(REPO / "scripts" / "build-image.sh"), "--release", release,
                           "--out", str(out / f"{release}.oci.tar")], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    cluster.ctr("images", "import", "--snapshotter", "overlayfs", facts["archive"])
    listed = {line.split()[0]: line.split()[2] for line in cluster.ctr("images", "ls").stdout.splitlines()[1:]}
    assert listed.get(facts["image"]) == facts["digest"], f"containerd holds {listed.get(facts['image'])}"
    cluster.ctr("images", "tag", facts["image"], facts["pinned"])
    return ReleaseImage(facts["image"], facts["pinned"], facts["digest"], Path(facts["archive"]))


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("the real cluster (scripts/cluster.sh)")
        for line in REPORT:
            terminalreporter.write_line(line)
