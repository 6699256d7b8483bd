"""Issue 16, point 2: a DaemonSet rollout (or rollback) meets pods added by the other version.

The previous release (0.1.0, commit add2a6f) is installed from git into a temp venv that reuses
the project venv's dependencies; ADD runs with one build and DEL with the other, in real
namespaces, and nothing may be left: pod links, source rules, host-local leases, state files.
0.2.0 names rail 0 CNI_IFNAME when not chained (0.1.0 did so only for a lone rail) and writes
released/ markers: each version must find the other's interfaces by what the state recorded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_plugin
from tests.netns.conftest import ipj

pytestmark = pytest.mark.netns

PREVIOUS_RELEASE = "add2a6f"  # 0.1.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def previous_build(tmp_path_factory) -> str:
    """The previous release's `rdma-netns`, in a venv of its own (deps from this venv)."""
    if not (REPO / ".git").exists():
        pytest.skip("needs the git history to check out the previous release")
    base = tmp_path_factory.mktemp("h16-previous")
    src = base / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # A wheel built by this venv's pip (`pip wheel` installs nothing here), installed by the new
    # venv's own pip before the deps are visible: this venv's rdma-netns is never touched.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(base / "wheel"), str(src)], check=True,
                   capture_output=True)
    (wheel,) = (base / "wheel").glob("rdma_netns-*.whl")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--disable-pip-version-check", str(wheel)], check=True, capture_output=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = next(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))
    (site / "zz-project-deps.pth").write_text(deps + "\n")
    exe = venv / "bin" / "rdma-netns"
    version = subprocess.run([str(python), "-c", "import rdma_netns; print(rdma_netns.__version__)"],
                             check=True, capture_output=True, text=True).stdout.strip()
    assert version == "0.1.0", version
    return str(exe)


# Keys added after 0.1.0, which that release refuses (it predates issue 16's lenient DEL): the
# previous build gets the config it knows, as a node rolled back with its old conflist does.
NEWER_KEYS = ("podInfoDir", "cdiSpecDir", "cdiKind", "pairing")


def cni(node, build: str | None, command: str, conf: dict, pod: str | None, container_id: str, ifname: str):
    if build is not None:
        conf = {k: v for k, v in conf.items() if k not in NEWER_KEYS}
    path = node.netns_path(pod) if pod else ""
    return run_plugin(command, conf, container_id=container_id, netns=path, ifname=ifname,
                      node_netns=node.name, plugin=build)


def leftovers(node, pod: str) -> dict:
    return {
        "links": sorted(n for n in node.links(pod) if n != "lo"),
        "rules": [r for fam in ("-4", "-6") for r in ipj(fam, "-n", pod, "rule") if r.get("src", "all") != "all"],
        "leases": node.allocations(),
        "state": node.attachment_records(),
    }


CASES = {
    "one-rail": dict(rails=1),
    "two-rails-unnamed": dict(rails=2, unnamed=True),  # rail 0's name differs between the versions
    "two-rails-named": dict(rails=2),
}


@pytest.mark.parametrize("direction", ["old-add-new-del", "new-add-old-del"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_other_version_deletes_cleanly(node, previous_build, direction, case):
    spec = CASES[case]
    conf = node.conf(rails=spec["rails"])
    if spec.get("unnamed"):
        for rail in conf["rails"]:
            rail.pop("ifname", None)
    adder, deleter = (previous_build, None) if direction == "old-add-new-del" else (None, previous_build)
    pod = node.pod()
    result = cni(node, adder, "ADD", conf, pod, "skew1", "eth0")
    result.ok()
    names = sorted(i["name"] for i in result.json["interfaces"] if i.get("sandbox"))
    assert len(names) == spec["rails"] and sorted(leftovers(node, pod)["links"]) == names
    assert leftovers(node, pod)["leases"] and leftovers(node, pod)["rules"]

    cni(node, deleter, "DEL", conf, pod, "skew1", "eth0").ok()
    assert leftovers(node, pod) == {"links": [], "rules": [], "leases": [], "state": []}
    # containerd's repeats, by either build, still succeed and change nothing.
    cni(node, deleter, "DEL", conf, None, "skew1", "eth0").ok()
    cni(node, adder, "DEL", conf, None, "skew1", "eth0").ok()
    assert leftovers(node, pod) == {"links": [], "rules": [], "leases": [], "state": []}


def test_a_rollback_then_upgrade_again(node, previous_build):
    """new ADD -> old DEL of one pod while the old build ADDs another -> new DEL of it."""
    conf = node.conf(rails=2)
    for rail in conf["rails"]:
        rail.pop("ifname", None)
    pod_a, pod_b = node.pod(), node.pod()
    cni(node, None, "ADD", conf, pod_a, "a", "eth0").ok()
    cni(node, previous_build, "ADD", conf, pod_b, "b", "eth0").ok()
    cni(node, previous_build, "DEL", conf, pod_a, "a", "eth0").ok()
    cni(node, None, "DEL", conf, pod_b, "b", "eth0").ok()
    for pod in (pod_a, pod_b):
        assert leftovers(node, pod) == {"links": [], "rules": [], "leases": [], "state": []}
