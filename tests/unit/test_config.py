"""The config contract (pydantic model) and the cached loader in front of it."""

from __future__ import annotations

import os
import stat

import pytest

from rdma_netns.config import loader, model
from rdma_netns.spec.errors import CniError

IPAM = {"type": "host-local", "ranges": [[{"subnet": "fd00:1::/64"}]]}


def conf(**kw):
    base = {"cniVersion": "1.1.0", "name": "rdma", "type": "rdma-netns", "rails": [{"netdev": "eth1", "ipam": IPAM}]}
    if "resourceName" not in kw:
        base["pairing"] = False  # unpaired on purpose (tests without kubelet)
    base.update(kw)
    return base


def test_defaults_are_filled_in():
    net = model.validate(conf())
    assert net["mode"] == "auto" and net["link"] == "macvlan" and net["linkMode"] == "bridge"
    assert net["requireRdma"] is True and net["stateDir"] == "/var/lib/cni/rdma-netns"
    assert net["rails"][0]["rdmaDevice"] is None
    assert model.validate(conf(link="ipvlan"))["linkMode"] == "l2"


def test_runtime_keys_are_not_part_of_the_contract():
    model.validate(conf(args={"cni": {}}, runtimeConfig={"mac": "x"}, prevResult={},
                        **{"cni.dev/valid-attachments": []}))


@pytest.mark.parametrize("bad,field", [
    ({"bogus": 1}, "bogus"),
    ({"rails": [{"netdev": "eth1", "ipam": IPAM, "extra": 1}]}, "rails.0.extra"),
    ({"rails": [{"ipam": IPAM}]}, "rails.0"),
    ({"rails": [{"netdev": "a", "ifname": "x", "ipam": IPAM}, {"netdev": "b", "ifname": "x", "ipam": IPAM}]},
     "duplicate"),
    ({"ipam": None, "rails": None, "mode": "shared"}, "ipam"),
    ({"gidWaitMs": -1}, "gidWaitMs"),
    ({"ipam": {"type": "a/b"}}, "ipam.type"),
    # the IPAM keys rdma-netns reads itself (rails/ipam.py, status): host-local's types, named
    ({"rails": [{"netdev": "eth1", "ipam": {"type": "host-local", "ranges": -1}}]}, "rails.0.ipam: ranges must"),
    ({"ipam": {"type": "host-local", "ranges": [[{"subnet": None}]]}}, "ipam: ranges.0.0.subnet must"),
    ({"ipam": {"type": "static", "routes": [{"dst": 1}]}}, "ipam: routes.0 must"),
    ({"ipam": {"type": "host-local", "dataDir": "relative"}}, "ipam: dataDir must"),
])
def test_errors_name_the_field(bad, field):
    with pytest.raises(Exception) as err:
        model.validate(conf(**bad))
    assert field in model.describe_errors(err.value)


# --- pairing: said, never left out by mistake (issue 36) ---------------------------------------------

def unpaired(**kw):
    """conf() without the tests' own "pairing": false."""
    raw = conf()
    raw.pop("pairing")
    raw.update(kw)
    return raw


def test_a_config_without_resource_name_must_say_pairing_is_off():
    with pytest.raises(Exception) as err:
        model.validate(unpaired())
    text = model.describe_errors(err.value)
    assert "resourceName is missing" in text
    assert '"resourceName": "rdma/hca"' in text and '"pairing": false' in text  # the two fixes
    assert model.validate(unpaired(pairing=False))["pairing"] is False
    assert model.validate(unpaired(resourceName="rdma/hca"))["resourceName"] == "rdma/hca"
    assert model.validate(unpaired(resourceName="rdma/hca", pairing=True))["pairing"] is True
    with pytest.raises(Exception) as err:
        model.validate(unpaired(pairing=True))  # pairing on, but with which resource?
    assert "resourceName is missing" in model.describe_errors(err.value)
    with pytest.raises(Exception) as err:
        model.validate(unpaired(resourceName="rdma/hca", pairing=False))
    assert "keep one of them" in model.describe_errors(err.value)
    with pytest.raises(Exception) as err:
        model.validate(unpaired(pairing="sometimes"))
    assert "pairing" in model.describe_errors(err.value)


def test_a_config_without_resource_name_is_refused_with_code_7(tmp_path):
    with pytest.raises(CniError) as err:
        loader.load(unpaired(stateDir=str(tmp_path / "st")))
    assert err.value.code == 7 and "resourceName is missing" in err.value.msg


def test_the_keys_multus_adds_for_its_resource_annotation_are_accepted_and_not_the_identity(tmp_path):
    """A NetworkAttachmentDefinition annotated k8s.v1.cni.cncf.io/resourceName: Multus adds the
    device it took from the pod's grant to each plugin as deviceID (and pciBusID, Multus 4)."""
    raw = unpaired(resourceName="rdma/hca", stateDir=str(tmp_path / "st"))
    first = loader.load(dict(raw, deviceID="hca-0003", pciBusID="hca-0003"))
    second = loader.load(dict(raw, deviceID="hca-0007"))
    assert first.net.source == second.net.source and first.net.resource_name == "rdma/hca"
    assert len(list((tmp_path / "st" / "verified-configs").iterdir())) == 1


def test_loader_caches_the_verdict(tmp_path):
    state = str(tmp_path / "st")
    raw = conf(stateDir=state)
    first = loader.load(dict(raw, runtimeConfig={"mac": "02:00:00:00:00:01"}))
    cache_dir = tmp_path / "st" / "verified-configs"
    (entry,) = list(cache_dir.iterdir())
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    # Another invocation of the same network (different runtime keys) reads the cache.
    second = loader.load(dict(raw, runtimeConfig={"deviceID": "0000:3b:00.0"}))
    assert second.net.source == first.net.source
    assert second.runtime.device_id == "0000:3b:00.0" and first.runtime.mac == "02:00:00:00:00:01"
    # Key order does not matter; content does.
    reordered = dict(reversed(list(raw.items())))
    loader.load(reordered)
    assert len(list(cache_dir.iterdir())) == 1
    loader.load(dict(raw, gidWaitMs=10))
    assert len(list(cache_dir.iterdir())) == 2


def test_invalid_config_is_never_cached(tmp_path):
    state = str(tmp_path / "st")
    with pytest.raises(CniError) as err:
        loader.load(conf(stateDir=state, bogus=True))
    assert err.value.code == 7
    assert not (tmp_path / "st" / "verified-configs").exists() or not os.listdir(tmp_path / "st" / "verified-configs")


def test_a_tampered_cache_entry_is_not_trusted_blindly(tmp_path):
    """A garbage cache file reads as missing, so the config is validated again."""
    state = str(tmp_path / "st")
    loader.load(conf(stateDir=state))
    (entry,) = list((tmp_path / "st" / "verified-configs").iterdir())
    entry.write_text("garbage")
    assert loader.load(conf(stateDir=state)).net.name == "rdma"


def test_gc_attachments_parsed(tmp_path):
    cfg = loader.load(conf(stateDir=str(tmp_path), **{
        "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]}))
    assert cfg.valid_attachments == {("a", "eth0")}
    with pytest.raises(CniError):
        loader.load(conf(stateDir=str(tmp_path), **{"cni.dev/valid-attachments": [{"containerID": 1}]}))


@pytest.mark.parametrize("name", ["locks", "verified-configs"])
def test_reserved_network_names_are_refused(tmp_path, name):
    """A network named like a folder the state folder keeps beside the networks' would share it."""
    with pytest.raises(CniError) as err:
        loader.load(conf(stateDir=str(tmp_path), name=name))
    assert err.value.code == 7 and "reserved" in err.value.msg and name in err.value.msg
    # DEL still finds what an older version (which allowed the name) may have attached.
    assert loader.load_for_teardown(conf(stateDir=str(tmp_path), name=name)).net.name == name


def test_the_plugin_version_is_part_of_the_cache_key(tmp_path, monkeypatch):
    """An upgrade that changes defaults must not be served the previous version's verdict."""
    raw = conf(stateDir=str(tmp_path))
    loader.load(raw)
    cache = tmp_path / "verified-configs"
    first = {p.name for p in cache.iterdir()}
    monkeypatch.setattr(loader, "__version__", "99.0.0")
    loader.load(raw)
    assert len(first) == 1 and len({p.name for p in cache.iterdir()} - first) == 1


def test_network_config_is_typed():
    from rdma_netns.config.netconf import NetConfig

    net = NetConfig(model.validate(conf(routeTableBase=300, gidWaitMs=0)))
    assert (net.name, net.link, net.link_mode, net.route_table_base, net.gid_wait_ms) == \
        ("rdma", "macvlan", "bridge", 300, 0)
    assert net.teardown_settings() == {"routeTableBase": 300, "rulePriorityBase": 1000, "ipamTimeoutSeconds": 30.0,
                                       "link": "macvlan", "linkMode": "bridge"}
    recorded = net.with_recorded({"routeTableBase": 500, "link": "ipvlan", "rulePriorityBase": "x"})
    assert (recorded.route_table_base, recorded.link, recorded.rule_priority_base) == (500, "ipvlan", 1000)
    assert net.route_table_base == 300  # the original is untouched
