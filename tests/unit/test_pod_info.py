"""pod_info: the rails record and the environment a pod's containers get (issue 17's contract)."""

from __future__ import annotations

from rdma_netns.kernel.inet import Prefix
from rdma_netns.publish import pod_info


def rails(*specs):
    """(ifname, addresses, device, gid index) -> rail entries on netdevs rail0.."""
    return [pod_info.rail_entry(ifname, f"rail{i}", addrs, device, 1 if device else None, index)
            for i, (ifname, addrs, device, index) in enumerate(specs)]


def test_equal_indexes_set_one_gid_index_for_nccl_and_ucx():
    r = rails(("rdma0", ["fd00:1::5/64"], "mlx5_0", 3), ("rdma1", ["fd00:2::5/64"], "mlx5_1", 3))
    rec = pod_info.record("net", "cid", "eth0", "shared", r)
    assert rec["gidIndexesEqual"] is True
    assert rec["env"] == {
        "NCCL_SOCKET_IFNAME": "=rdma0,rdma1", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1",
        "NCCL_IB_ADDR_FAMILY": "AF_INET6", "NCCL_IB_GID_INDEX": "3", "UCX_IB_GID_INDEX": "3",
        "RDMA_NETNS_RAILS_FILE": "/etc/rdma-netns/rails.json"}
    assert rec["rails"][0] == {"ifname": "rdma0", "netdev": "rail0", "addresses": ["fd00:1::5/64"],
                               "rdmaDevice": "mlx5_0", "port": 1, "gidIndex": 3,
                               "gid": "fd00:0001:0000:0000:0000:0000:0000:0005"}
    assert {k: rec[k] for k in ("version", "network", "containerID", "ifname", "mode")} == \
        {"version": 1, "network": "net", "containerID": "cid", "ifname": "eth0", "mode": "shared"}


def test_unequal_indexes_leave_the_index_unset_and_narrow_the_address_range():
    r = rails(("rdma0", ["fd00:1::5/64"], "mlx5_0", 3), ("rdma1", ["fd00:1::9/64"], "mlx5_1", 4))
    env = pod_info.environment(r)
    assert pod_info.gid_indexes_equal(r) is False
    assert "NCCL_IB_GID_INDEX" not in env and "UCX_IB_GID_INDEX" not in env
    assert env["NCCL_IB_ADDR_RANGE"] == "fd00:1::/124"  # 5 and 9 differ in the low 4 bits
    r = rails(("rdma0", ["fd00:1::5/64"], "mlx5_0", 3), ("rdma1", ["fd00:2::5/64"], "mlx5_1", 2))
    assert pod_info.environment(r)["NCCL_IB_ADDR_RANGE"] == "fd00::/30"


def test_unknown_indexes_count_as_not_equal():
    r = rails(("rdma0", ["fd00:1::5/64"], "mlx5_0", None), ("rdma1", ["fd00:2::5/64"], "mlx5_1", None))
    env = pod_info.environment(r)
    assert not pod_info.gid_indexes_equal(r) and "NCCL_IB_GID_INDEX" not in env
    assert env["NCCL_IB_ADDR_RANGE"] == "fd00::/30"


def test_rails_without_an_rdma_device_are_left_out_of_the_device_lists():
    r = rails(("rdma0", ["fd00:1::5/64"], "mlx5_0", 2), ("rdma1", ["fd00:2::5/64"], None, 7))
    rec = pod_info.record("net", "cid", "rdma0", "shared", r)
    assert rec["rails"][1]["rdmaDevice"] is None and rec["rails"][1]["gidIndex"] is None
    assert rec["rails"][1]["gid"] is None and rec["rails"][1]["port"] is None
    env = rec["env"]
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert env["NCCL_SOCKET_IFNAME"] == "=rdma0,rdma1"
    assert env["NCCL_IB_GID_INDEX"] == "2" and rec["gidIndexesEqual"] is True


def test_no_rdma_device_at_all_gives_only_the_socket_interfaces():
    r = rails(("rdma0", ["fd00:1::5/64"], None, None))
    assert pod_info.environment(r) == {"NCCL_SOCKET_IFNAME": "=rdma0",
                                       "RDMA_NETNS_RAILS_FILE": "/etc/rdma-netns/rails.json"}
    assert pod_info.gid_indexes_equal(r) is False
    assert pod_info.environment([]) == {}


def test_ipv4_rails_say_af_inet_and_their_gid_is_ipv4_mapped():
    r = rails(("rdma0", ["10.1.0.5/24"], "mlx5_0", 1), ("rdma1", ["10.2.0.5/24"], "mlx5_1", 2))
    env = pod_info.environment(r)
    assert env["NCCL_IB_ADDR_FAMILY"] == "AF_INET"
    assert env["NCCL_IB_ADDR_RANGE"] == "10.0.0.0/14"
    assert r[0]["gid"] == "0000:0000:0000:0000:0000:ffff:0a01:0005"


def test_covering_prefix():
    cover = pod_info.covering_prefix
    assert str(cover([Prefix.parse("fd00::a")])) == "fd00::a/128"
    assert str(cover([Prefix.parse("fd00::a"), Prefix.parse("fd00::b")])) == "fd00::a/127"
    assert str(cover([Prefix.parse("10.0.0.1"), Prefix.parse("10.0.0.1")])) == "10.0.0.1/32"
    assert str(cover([Prefix.parse("0.0.0.0"), Prefix.parse("128.0.0.0")])) == "0.0.0.0/0"
    assert cover([]) is None
    assert cover([Prefix.parse("10.0.0.1"), Prefix.parse("fd00::1")]) is None


def test_config_keys_defaults_and_validation():
    import pytest
    from pydantic import ValidationError

    from rdma_netns.config import model
    from rdma_netns.config.netconf import NetConfig

    base = {"cniVersion": "1.0.0", "name": "n", "type": "rdma-netns", "ipam": {"type": "host-local"}, "pairing": False}
    net = NetConfig(model.validate(base))
    assert (net.pod_info_dir, net.cdi_spec_dir, net.cdi_kind) == \
        ("/run/rdma-netns/pods", "/var/run/cdi", "rdma-netns.io/pod")
    net = NetConfig(model.validate({**base, "podInfoDir": "", "cdiSpecDir": "/etc/cdi/", "cdiKind": "example.com/net"}))
    assert (net.pod_info_dir, net.cdi_spec_dir, net.cdi_kind) == ("", "/etc/cdi", "example.com/net")
    for key, value in (("podInfoDir", "run/pods"), ("podInfoDir", "/run/../etc"), ("podInfoDir", "/"),
                       ("cdiSpecDir", ""), ("cdiSpecDir", "cdi"), ("cdiKind", "pod"), ("cdiKind", "a/b/c"),
                       ("cdiKind", "rdma-netns.io/p.od"), ("cdiKind", "-x.io/pod")):
        with pytest.raises(ValidationError):
            model.validate({**base, key: value})


FABRIC_OWNED = ("NCCL_IB_TC", "NCCL_IB_SL", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_PCI_RELAXED_ORDERING",
                "UCX_IB_TRAFFIC_CLASS", "UCX_IB_SL", "UCX_RC_TIMEOUT", "UCX_RC_RETRY_COUNT")


def test_the_fabrics_settings_are_never_published():
    """Traffic class, service level and timeouts are the fabric's QoS (Lingjun: NCCL_IB_TC=136,
    NCCL_IB_SL=5): whatever the rails look like, the published settings leave them to the job."""
    for specs in ([("rdma0", ["fd00:1::5/64"], "mlx5_bond_0", 3), ("rdma1", ["fd00:2::5/64"], "mlx5_bond_1", 3)],
                  [("rdma0", ["fd00:1::5/64"], "mlx5_bond_0", 3), ("rdma1", ["fd00:2::6/64"], "mlx5_bond_1", 4)],
                  [("rdma0", ["10.0.0.5/24"], "mlx5_0", None)]):
        env = pod_info.record("net", "cid", "eth0", "shared", rails(*specs))["env"]
        assert not set(env) & set(FABRIC_OWNED)
        nccl, rest = pod_info.split_env(env)
        assert all(k.startswith("NCCL_") for k in nccl) and not any(k.startswith("NCCL_") for k in rest)
        text = pod_info.nccl_conf(nccl)
        assert [ln for ln in text.splitlines() if "=" in ln] == [f"{k}={v}" for k, v in sorted(nccl.items())]
        assert all("=" not in ln for ln in text.splitlines() if ln.startswith("#")), \
            "old NCCL versions do not skip '#' lines: a comment must not look like NAME=value"
