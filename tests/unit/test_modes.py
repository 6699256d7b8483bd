"""Modes behind one protocol (issue 15): the commands ask a mode's capabilities, never its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rdma_netns import commands, modes
from rdma_netns.config.netconf import NetConfig
from rdma_netns.kernel import rdma_sysfs
from rdma_netns.modes.base import Mode
from rdma_netns.modes.exclusive import ExclusiveMode
from rdma_netns.modes.rdma_device import RdmaDeviceMode
from rdma_netns.modes.shared import SharedMode

IPAM = {"type": "host-local"}


def net(**kw) -> NetConfig:
    base = {"name": "n", "stateDir": "/nonexistent", "mode": "auto", "link": "macvlan", "linkMode": "bridge",
            "ipam": IPAM, "rails": [{"netdev": "eth1"}]}
    base.update(kw)
    return NetConfig(base)


@pytest.fixture
def kernel(monkeypatch):
    def set_mode(mode: str | None) -> None:
        monkeypatch.setattr(rdma_sysfs, "netns_mode", lambda: mode)
    return set_mode


def test_select_by_kernel_and_chaining(kernel):
    kernel("shared")
    shared = modes.select(net())
    assert isinstance(shared, SharedMode) and shared.parent_must_be_up and not shared.gids_in_pod
    assert (shared.link_kind, shared.link_mode) == ("macvlan", "bridge")
    kernel("exclusive")
    whole_nic = modes.select(net(), chained=True)  # chained with IPAM: whole NICs, like a network of its own
    assert isinstance(whole_nic, ExclusiveMode) and whole_nic.gids_in_pod and whole_nic.grant_names_devices
    device_only = modes.select(net(ipam=None, rails=[{"rdmaDevice": "mlx5_0"}]), chained=True)
    assert isinstance(device_only, RdmaDeviceMode) and not device_only.configures_addresses
    assert isinstance(modes.select(net(ipam=None, rails=[{"rdmaDevice": "mlx5_0"}])), ExclusiveMode)


def test_for_state_reads_the_record():
    assert isinstance(modes.for_state("exclusive", "rdma-device", [], net()), RdmaDeviceMode)
    assert isinstance(modes.for_state("exclusive", "", [{"rdmaOnly": True}], net()), RdmaDeviceMode)
    assert isinstance(modes.for_state("exclusive", "netdev", [], net()), ExclusiveMode)
    ipvlan = modes.for_state("shared", "ipvlan", [], net(linkMode="l2"))
    assert isinstance(ipvlan, SharedMode) and ipvlan.link_kind == "ipvlan"
    assert isinstance(modes.for_state("", "", [], net()), SharedMode)  # a foreign record: never moves NICs


def test_every_mode_is_a_mode_with_slots():
    for cls in (SharedMode, ExclusiveMode, RdmaDeviceMode):
        assert issubclass(cls, Mode) and "__slots__" in cls.__dict__
    assert RdmaDeviceMode().link_kind == modes.RDMA_DEVICE_LINK


def test_the_commands_never_test_a_mode_by_name():
    sources = sorted(Path(commands.__file__).parent.glob("*.py"))
    assert {p.name for p in sources} >= {"add.py", "teardown.py", "check.py", "status.py", "gc.py"}
    for path in sources:
        source = path.read_text()
        assert not re.search(r"mode(_name)?\.name\s*[!=]=|mode_name\s*[!=]=|== \"(shared|exclusive)\"", source), path
        assert "rdmaOnly" not in source, path  # the chained RDMA-device-only attachment lives in modes/


def test_effective_mode_uses_the_one_rule():
    from rdma_netns import mode_policy
    from rdma_netns.spec.errors import CniError

    with pytest.raises(CniError) as err:
        modes.effective_mode("exclusive", "shared")
    assert err.value.code == 103 and mode_policy.fix_hint("exclusive") in err.value.details
