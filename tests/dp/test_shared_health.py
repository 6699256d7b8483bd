"""Issue 16, point 5: shared-mode health, "any" (default: one selected device with an ACTIVE port
keeps the units Healthy) against the stricter "all" (every selected device must have one)."""

from __future__ import annotations

import time

import pytest

from rdma_netns_dp.config import ConfigError, ResourceConfig, validate
from rdma_netns_dp.inventory import Pool
from tests.dp.conftest import INTERVAL, RESOURCE, Host


def config(rule: str | None) -> dict:
    resource: dict = {"name": RESOURCE, "sharedUnits": 8}
    if rule is not None:
        resource["sharedHealth"] = rule
    return {"mode": "shared", "resources": [resource]}


def test_the_config_key():
    assert validate(config(None), "t").resources[0].sharedHealth == "any"
    assert validate(config("all"), "t").resources[0].sharedHealth == "all"
    with pytest.raises(ConfigError, match="sharedHealth"):
        validate(config("most"), "t")


@pytest.mark.parametrize("rule,states,expected", [
    ("any", [True, False], True), ("any", [False, False], False), ("all", [True, False], False),
    ("all", [True, True], True), ("all", [], False), ("any", [], False)])
def test_pool_rule(rule, states, expected, monkeypatch):
    from rdma_netns_dp import inventory

    monkeypatch.setattr(inventory, "matches", lambda d, s: True)
    devices = [type("D", (), {"healthy": h, "name": f"d{i}", "stable_id": f"d{i}", "numa_node": 0})()
               for i, h in enumerate(states)]
    pool = Pool(ResourceConfig(name=RESOURCE, sharedUnits=3, sharedHealth=rule), "shared")
    pool.update(devices)
    assert {u.healthy for u in pool.units} == {expected}


@pytest.mark.parametrize("rule", ["any", "all"])
def test_shared_units_with_one_device_down(host: Host, rule: str):
    daemon, plugin = host.start_registered(config=config(rule))
    assert set(plugin.latest.health().values()) == {"Healthy"}
    first = next(iter(host.fake.devices))
    host.fake.set_port_state(first, "DOWN")
    if rule == "all":
        update = plugin.wait_for(lambda u: set(u.health().values()) == {"Unhealthy"}, 5, "all Unhealthy")
        assert len(update.ids()) == 8
        host.fake.set_port_state(first, "ACTIVE")
        plugin.wait_for(lambda u: set(u.health().values()) == {"Healthy"}, 5, "Healthy again")
    else:
        time.sleep(4 * INTERVAL)
        assert set(plugin.latest.health().values()) == {"Healthy"}, "one DOWN device of many: still Healthy"
    assert daemon.alive()


def test_units_are_unhealthy_while_ib_uverbs_is_not_loaded(host: Host):
    """Found on the real cluster's guest node: Soft-RoCE up, ib_uverbs not loaded, the units
    advertised Healthy, and kubelet's Allocate then failed every pod of the Job
    (UnexpectedAdmissionError). Unhealthy keeps the scheduler away, and the log says why."""
    daemon, plugin = host.start_registered(config=config(None))
    assert set(plugin.latest.health().values()) == {"Healthy"}
    host.fake.unload_uverbs()
    plugin.wait_for(lambda u: set(u.health().values()) == {"Unhealthy"}, 5, "Unhealthy without uverbs")
    assert "ib_uverbs is loaded" in daemon.stderr()
    host.fake.load_uverbs()
    plugin.wait_for(lambda u: set(u.health().values()) == {"Healthy"}, 5, "Healthy again")
    assert daemon.alive()
