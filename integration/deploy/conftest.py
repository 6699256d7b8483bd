"""Fixtures of the deploy suite: two images built by scripts/build-image.sh (releases A and B, for
the rolling update), and one node (rig.py) per module; the figures it measured, at the end."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration.cri.rig import CONTAINERD_17, missing_tools
from integration.deploy.rig import REPO, DeployNode

REPORT: list[str] = []


@dataclass(frozen=True)
class BuiltImage:
    name: str
    release: str
    archive: Path
    facts: dict

    @property
    def pinned(self) -> str:
        """The reference by digest the build printed (repository@sha256:...), as docs/install.md pins it."""
        return self.facts["pinned"]


def need_root_and_containerd17() -> None:
    why = None
    if os.geteuid() != 0:
        why = "needs root"
    elif missing_tools(CONTAINERD_17):
        why = f"needs {', '.join(missing_tools(CONTAINERD_17))} (scripts/setup.sh)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the deploy suite {why}; CI must provide it")
        pytest.skip(why)


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> dict[str, BuiltImage]:
    """Image A and image B of this checkout, as two releases (what a rolling update swaps)."""
    need_root_and_containerd17()
    out = tmp_path_factory.mktemp("images")
    commit = subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "nogit"
    built = {}
    for label in ("a", "b"):
        release = f"deploy-{label}-{commit}-{os.urandom(2).hex()}"
        # --test-hooks: the CNI honours RDMA_NETNS_SYSFS_ROOT / RDMA_NETNS_DEV_ROOT (rig.py's fake NICs)
        proc = subprocess.run([str(REPO / "scripts" / "build-image.sh"), "--release", release, "--test-hooks",
                               "--out", str(out / f"{release}.oci.tar")], capture_output=True, text=True,
                              timeout=1800)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
        built[label] = BuiltImage(facts["image"], release, Path(facts["archive"]), facts)
        REPORT.append(f"image {label}: {facts['pinned']} built in {facts['seconds']} s; archive "
                      f"{facts['archiveBytes'] / 2**20:.0f} MiB, release folder (what lands on the host) "
                      f"{facts['releaseBytes'] / 2**20:.0f} MiB; Debian packages as of {facts['debianDate']}")
    return built


@pytest.fixture(scope="module")
def node(images):
    work = Path(tempfile.mkdtemp(prefix="rdeploy-", dir="/var/tmp"))
    n = DeployNode(work)
    try:
        for image in images.values():
            n.rig.import_image(image.archive)
            n.pin(image.name, image.facts["digest"], image.pinned)  # docs/install.md, "Pin the image"
        yield n
    finally:
        n.close()
        remnants = n.rig.remnants()
        assert not remnants, f"the rig left {remnants}"


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("the DaemonSet through containerd 1.7's CRI")
        for line in REPORT:
            terminalreporter.write_line(line)
