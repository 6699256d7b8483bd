"""The admin CLI and the shipped config examples."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import REPO, installed_executable, plugin_path


def run(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run([plugin_path(), *args], capture_output=True, text=True, env=env)


def test_help_and_version():
    out = run("--help")
    assert out.returncode == 0 and "CNI plugin" in out.stdout
    assert run("--version").stdout.startswith("rdma-netns ")


def test_every_shipped_conflist_validates():
    files = sorted((REPO / "conf").glob("*.conflist"))
    assert files
    for f in files:
        out = run("check-config", str(f))
        assert out.returncode == 0, out.stderr


def test_check_config_names_the_bad_field(tmp_path: Path):
    bad = tmp_path / "bad.conflist"
    bad.write_text(json.dumps({"cniVersion": "1.1.0", "name": "x",
                               "plugins": [{"type": "rdma-netns", "ipam": {"type": "host-local"}, "railz": 1}]}))
    out = run("check-config", str(bad))
    assert out.returncode == 1 and "railz: unknown field" in out.stderr


def test_devices_json_is_a_list():
    out = run("devices", "--json")
    assert out.returncode == 0 and isinstance(json.loads(out.stdout), list)


def test_launcher_is_isolated_and_runs_the_installed_package(tmp_path: Path):
    dest = tmp_path / "rdma-netns"
    out = subprocess.run([installed_executable(), "install-launcher", str(dest)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    first = dest.read_text().splitlines()[0]
    assert first.startswith("#!/") and first.endswith(" -IS")
    assert dest.stat().st_mode & 0o777 == 0o755
    # PYTHONPATH from the runtime's environment cannot redirect the import.
    evil = tmp_path / "evil" / "rdma_netns"
    evil.mkdir(parents=True)
    (evil / "__init__.py").write_text("raise SystemExit('hijacked')")
    version = subprocess.run([str(dest)], input=b"{}", capture_output=True,
                             env={"CNI_COMMAND": "VERSION", "PYTHONPATH": str(evil.parent)})
    assert version.returncode == 0 and json.loads(version.stdout)["supportedVersions"]


def test_mode_on_a_kernel_without_rdma_and_persist(tmp_path: Path):
    import os

    if os.path.isdir("/sys/module/ib_core"):
        import pytest

        pytest.skip("this kernel has an RDMA core")
    show = run("mode")
    assert show.returncode == 1 and "no RDMA subsystem" in show.stderr
    target = tmp_path / "rdma-netns.conf"
    out = run("mode", "set", "exclusive", "--persist", "--modprobe-file", str(target))
    assert out.returncode == 0, out.stderr
    assert "options ib_core netns_mode=0" in target.read_text()
    assert run("mode", "set").returncode == 2  # a value is required


PLUGIN_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "ours":
    from rdma_netns.config import model
    model.validate({"cniVersion": "1.1.0", "name": "n", "type": "rdma-netns", "rails": [{"netdev": "eth9"}], "pairing": False,
                    "ipam": {"type": "host-local"}})
else:  # a model of anyone else's, built the same way
    import pydantic
    class Other(pydantic.BaseModel):
        x: int
    Other(x=1)
"""


def test_validation_loads_no_pydantic_plugin(tmp_path: Path):
    """pydantic imports every installed package's `pydantic` entry point when it builds a model;
    the root plugin validating a config must not run such code (a package on the node's path)."""
    marker = tmp_path / "plugin-loaded"
    (tmp_path / "sneaky_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                             "class Plugin:\n"
                                             "    def new_schema_validator(self, *args, **kw):\n"
                                             "        return None, None, None\n"
                                             "plugin = Plugin()\n")
    dist = tmp_path / "sneaky_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sneaky-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pydantic]\nsneaky = sneaky_plugin:plugin\n")
    python = str(Path(installed_executable()).parent / "python")
    # Not inherited: a test before this one may have loaded the model into pytest's own process.
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}

    control = subprocess.run([python, "-c", PLUGIN_PROBE, str(tmp_path), "other"], capture_output=True, text=True,
                             env=env)
    assert control.returncode == 0 and marker.exists(), f"the probe cannot see a plugin load: {control.stderr}"
    marker.unlink()
    ours = subprocess.run([python, "-c", PLUGIN_PROBE, str(tmp_path), "ours"], capture_output=True, text=True,
                          env=env)
    assert ours.returncode == 0, ours.stderr
    assert not marker.exists(), "validating a config loaded a third-party pydantic plugin"


def test_check_config_takes_one_chained_entry(tmp_path: Path):
    """As its help says: an entry without cniVersion and name (they come from the conflist it is
    chained into), like the shipped chained entries."""
    for f in sorted((REPO / "conf").glob("rdma-netns-chained-entry*.json")):
        out = run("check-config", str(f))
        assert out.returncode == 0, (f.name, out.stderr)
    bad = tmp_path / "entry.json"
    bad.write_text(json.dumps({"type": "rdma-netns", "ipam": {"type": "host-local"}, "pairing": False, "railz": 1}))
    out = run("check-config", str(bad))
    assert out.returncode == 1 and "railz: unknown field" in out.stderr, out.stderr
