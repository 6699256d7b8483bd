"""Shared test helpers: where the plugin under test is, and how to run it as a runtime does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import hypothesis_profiles  # noqa: F401  (loads CI's deterministic profile, or HYPOTHESIS_PROFILE)

REPO = Path(__file__).resolve().parent.parent
CNI_BIN_DIR = os.environ.get("RDMA_NETNS_CNI_PATH", "/usr/lib/cni")


# The machine's own places a test could leave files in through a default path (a config without
# stateDir, podInfoDir or cdiSpecDir, a host-local without dataDir), and / itself (a "nonexistent"
# stateDir made real). Tests use their own temp folders; RDMA_NETNS_CHECK_LEAKS=1 (scripts/test.sh
# sets it: CI runs one suite at a time) fails a test that leaves anything new in them.
LEAK_WATCH = ("/var/lib/cni/rdma-netns", "/run/rdma-netns", "/run/cdi", "/etc/cdi", "/var/lib/cni/networks",
              "/etc/cni/net.d", "/opt/cni/bin")


def machine_paths() -> set[str]:
    """Everything under LEAK_WATCH, and the names at /."""
    found = {f"/{name}" for name in os.listdir("/")}
    for top in LEAK_WATCH:
        for folder, dirs, files in os.walk(top):
            found.add(folder)
            found.update(os.path.join(folder, name) for name in dirs + files)
    return found


@pytest.fixture(autouse=True)
def _leaves_nothing_on_the_machine():
    if os.environ.get("RDMA_NETNS_CHECK_LEAKS") != "1":
        yield
        return
    before = machine_paths()
    yield
    left = sorted(machine_paths() - before)
    if left:
        pytest.fail(f"the test left files on the machine (use the test's own folders): {left[:10]}")


def enable_test_hooks() -> None:
    """Make the test venv's installed rdma-netns a test build: it honours the test-only variables
    the suites set (RDMA_NETNS_FAULT_AT, RDMA_NETNS_SYSFS_ROOT, RDMA_NETNS_DEV_ROOT) only with the
    marker beside its package (cni/rdma_netns/testhooks.py). scripts/setup.sh writes it too; this
    puts it back after a plain `pip install --force-reinstall .`. Only in a virtual environment,
    never for RDMA_NETNS_BIN (someone else's install), and best effort: a read-only install (the
    guest's view of the host) keeps what it has."""
    if sys.prefix == sys.base_prefix or os.environ.get("RDMA_NETNS_BIN"):
        return
    try:
        found = subprocess.run([sys.executable, "-I", "-c",
                                "from rdma_netns import testhooks; print(testhooks.marker_path())"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        marker = Path(found)
        if found and not marker.exists():
            marker.write_text("a test build: the test-only variables are honoured (rdma_netns/testhooks.py)\n")
    except (OSError, subprocess.SubprocessError):
        pass


def pytest_configure(config) -> None:
    enable_test_hooks()


def installed_executable() -> str:
    """The rdma-netns executable of the installed package (not the source tree)."""
    beside = Path(sys.executable).parent / "rdma-netns"
    if beside.exists():
        return str(beside)
    found = shutil.which("rdma-netns")
    if not found:
        pytest.fail("rdma-netns is not installed: run scripts/setup.sh (or set RDMA_NETNS_BIN)")
    return found


_launcher: list[str] = []


def plugin_path() -> str:
    """What the runtime executes: the launcher a node's CNI bin folder gets (install-launcher)."""
    explicit = os.environ.get("RDMA_NETNS_BIN")
    if explicit:
        return explicit
    if not _launcher:
        folder = tempfile.mkdtemp(prefix="rdma-netns-cni-bin-")
        dest = os.path.join(folder, "rdma-netns")
        subprocess.run([installed_executable(), "install-launcher", dest], check=True, capture_output=True)
        _launcher.append(dest)
    return _launcher[0]


class CniResult:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.code = proc.returncode
        self.stdout = proc.stdout.decode()
        self.stderr = proc.stderr.decode()
        self.json = json.loads(self.stdout) if self.stdout.strip() else None

    def ok(self) -> dict | None:
        assert self.code == 0, f"plugin failed: {self.stdout} {self.stderr}"
        return self.json

    def error(self, code: int) -> dict:
        assert self.code != 0, f"expected error {code}, got success: {self.stdout}"
        assert self.json is not None, f"error without JSON on stdout: {self.stderr}"
        assert self.json["code"] == code, f"expected code {code}: {self.json}"
        assert self.json["msg"], "error without a message"
        assert "Traceback" not in self.stdout
        return self.json


def run_plugin(command: str, conf: dict | bytes | str, *, container_id: str = "c1", netns: str = "",
               ifname: str = "net1", node_netns: str | None = None, cni_path: str = CNI_BIN_DIR,
               extra_env: dict | None = None, timeout: float = 60, plugin: str | None = None) -> CniResult:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CNI_")}
    env.update(CNI_COMMAND=command, CNI_CONTAINERID=container_id, CNI_NETNS=netns, CNI_IFNAME=ifname,
               CNI_PATH=cni_path)
    env.update(extra_env or {})
    data = conf if isinstance(conf, bytes) else (conf if isinstance(conf, str) else json.dumps(conf)).encode()
    cmd = [plugin or plugin_path()]
    if node_netns:
        cmd = ["ip", "netns", "exec", node_netns] + cmd
    proc = subprocess.run(cmd, input=data, env=env, capture_output=True, timeout=timeout)
    return CniResult(proc)
