"""Limits every call keeps whatever another process or the runtime does (issue 36, item 5):
the cache-fill lock is waited for with a timeout, stdin is capped, and the test-only environment
variables do nothing in an install that is not a test build."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns


def run_or_fail(node, command: str, conf: dict, pod: str | None = None, timeout: float = 30, **kw):
    started = time.monotonic()
    try:
        result = node.cni(command, conf, pod, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} still waited after {timeout} s")
    return result, time.monotonic() - started


def test_a_held_fill_lock_delays_a_new_config_by_its_lock_timeout_only(node):
    """Another process holding locks/verified-configs.fill (stopped, or stuck on a dead disk) used to
    hang CHECK and DEL with a new config until killed; now they validate without the cache's lock
    after lockTimeoutSeconds, and answer as usual."""
    pod = node.pod()
    first = node.conf(lockTimeoutSeconds=1)
    node.cni("ADD", first, pod).ok()  # an accepted config: the state folder and its fill lock exist
    lock = Path(node.state_dir) / "locks" / "verified-configs.fill"
    assert lock.exists()
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        new = node.conf(lockTimeoutSeconds=1, gidWaitMs=1234)  # another digest: a cache miss
        result, took = run_or_fail(node, "CHECK", new, pod)
        result.ok()
        assert 0.9 < took < 15, took
        assert "verified-configs.fill" in result.stderr
        result, took = run_or_fail(node, "DEL", new, pod)
        result.ok()
        refused = node.conf(lockTimeoutSeconds=1, mode="turbo")
        result, took = run_or_fail(node, "ADD", refused, node.pod())
        result.error(7)
    finally:
        os.close(fd)
    assert set(node.links(pod)) == {"lo"}


def test_stdin_above_the_cap_is_a_decode_error(node):
    """A config of many megabytes used to be read whole (200 MB cost 790 MB of memory); above the
    cap (entry.MAX_STDIN) the call reads no further and answers code 6."""
    conf = node.conf()
    conf["args"] = {"padding": "x" * (5 << 20)}  # a runtime key: read, and otherwise ignored
    result, _took = run_or_fail(node, "STATUS", conf)
    err = result.error(6)
    assert "4 MiB" in err["msg"], err
    conf["args"] = {"padding": "x" * (3 << 20)}  # below the cap: an ordinary call
    run_or_fail(node, "STATUS", conf)[0].ok()


@pytest.fixture
def release_install(tmp_path):
    """The installed package as a release installs it: the same files without the test build's
    marker, run by a launcher the way a runtime runs /opt/cni/bin/rdma-netns."""
    probe = subprocess.run([sys.executable, "-I", "-c", "import rdma_netns, os; print(os.path.dirname("
                            "os.path.dirname(rdma_netns.__file__)))"], capture_output=True, text=True, check=True)
    site = Path(probe.stdout.strip())
    packages = tmp_path / "site-packages"
    shutil.copytree(site / "rdma_netns", packages / "rdma_netns",
                    ignore=shutil.ignore_patterns("TEST-HOOKS-ENABLED", "__pycache__"))
    launcher = tmp_path / "rdma-netns"
    launcher.write_text(f"#!{sys.executable} -IS\nimport sys\nsys.path[:0] = [{str(packages)!r}, {str(site)!r}]\n"
                        "from rdma_netns.entry import main\nsys.exit(main())\n")
    launcher.chmod(0o755)
    assert (site / "rdma_netns" / "TEST-HOOKS-ENABLED").exists(), "the test venv is a test build"
    assert not (packages / "rdma_netns" / "TEST-HOOKS-ENABLED").exists()
    return str(launcher)


def test_a_release_install_ignores_the_crash_point_variable(node, release_install):
    """RDMA_NETNS_FAULT_AT in the runtime's environment used to kill ADD halfway on any node."""
    pod = node.pod()
    conf = node.conf()
    result, _ = run_or_fail(node, "ADD", conf, pod, plugin=release_install,
                            extra_env={"RDMA_NETNS_FAULT_AT": "state-written"})
    result.ok()
    assert "RDMA_NETNS_FAULT_AT is a test hook; ignored" in result.stderr
    run_or_fail(node, "DEL", conf, pod, plugin=release_install)[0].ok()
    # the test build (the suites' own install) still honours it
    result, _ = run_or_fail(node, "ADD", conf, pod, extra_env={"RDMA_NETNS_FAULT_AT": "state-written"})
    assert result.code == -9, (result.code, result.stdout, result.stderr)
    run_or_fail(node, "DEL", conf, pod)[0].ok()


def test_a_release_install_ignores_the_sysfs_and_dev_roots(tmp_path, release_install):
    """RDMA_NETNS_DEV_ROOT changed the device paths written into CDI specs, RDMA_NETNS_SYSFS_ROOT
    what the plugin believes the kernel's RDMA devices are; a release reads /dev and /sys."""
    script = ("from rdma_netns.publish import pod_cdi; from rdma_netns.kernel import rdma_sysfs;"
              "print(pod_cdi.DEV_ROOT, rdma_sysfs.default.root)")
    env = dict(os.environ, RDMA_NETNS_SYSFS_ROOT=str(tmp_path / "sys"), RDMA_NETNS_DEV_ROOT=str(tmp_path / "dev"))
    site = Path(release_install).parent / "site-packages"
    released = subprocess.run([sys.executable, "-IS", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {script}"],
                              env=env, capture_output=True, text=True, check=True)
    assert released.stdout.split() == ["/dev", "/sys"], released.stdout
    assert "RDMA_NETNS_DEV_ROOT is a test hook; ignored" in released.stderr
    tested = subprocess.run([sys.executable, "-I", "-c", script], env=env, capture_output=True, text=True, check=True)
    assert tested.stdout.split() == [str(tmp_path / "dev"), str(tmp_path / "sys")], tested.stdout


def test_the_admin_tool_of_a_release_reads_the_real_sysfs(tmp_path, release_install):
    """`rdma-netns devices` of a release ignores RDMA_NETNS_SYSFS_ROOT too (one rule for all)."""
    env = dict(os.environ, RDMA_NETNS_SYSFS_ROOT=str(tmp_path / "no-such-sys"))
    out = subprocess.run([release_install, "devices", "--json"], env=env, capture_output=True, text=True)
    assert "RDMA_NETNS_SYSFS_ROOT is a test hook; ignored" in out.stderr
    assert str(tmp_path) not in out.stdout
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stdout  # this machine has no RDMA devices
