"""Rails alike share one host-local call (ipam.plan_calls): which rails share, how the answer is
dealt out, and, with Debian's real host-local binary, that the allocations, a failure's rollback
and the DEL behave as the per-rail calls did."""

from __future__ import annotations

import json
import os

import pytest

from rdma_netns.rails import execplugin, ipam
from rdma_netns.spec.errors import CniError

HOST_LOCAL_DIR = "/usr/lib/cni"


def host_local(subnet: str, data_dir: str = "/tmp/x", **more) -> dict:
    return {"type": "host-local", "dataDir": data_dir, "ranges": [[{"subnet": subnet, **more}]]}


def requests(*confs: dict) -> list[ipam.Request]:
    return [ipam.Request(conf, f"rdma{i}") for i, conf in enumerate(confs)]


def test_alike_rails_share_one_call_under_the_first_name():
    reqs = requests(*(host_local(f"fd00:{i + 1}::/64") for i in range(8)))
    (call,) = ipam.plan_calls(reqs, share=True)
    assert call.ifname == "rdma0" and call.members == list(range(8)) and call.sizes == [1] * 8
    assert [rs[0]["subnet"] for rs in call.ipam["ranges"]] == [f"fd00:{i + 1}::/64" for i in range(8)]
    assert call.ipam["dataDir"] == "/tmp/x" and reqs[0].ipam["ranges"] == [[{"subnet": "fd00:1::/64"}]]


@pytest.mark.parametrize("second", [
    host_local("fd00:1::/64"),                       # the same subnet
    host_local("fd00:1:0:0:8000::/65"),              # inside the first
    host_local("fd00::/16"),                         # around it
    host_local("fd00:2::/64", data_dir="/tmp/y"),    # another store
    {"type": "static", "addresses": [{"address": "fd00:2::5/64"}]},
    {"type": "host-local", "subnet": "fd00:2::/64"},  # host-local's legacy top-level range
    {"type": "host-local", "dataDir": "/tmp/x", "ranges": [[{"subnet": "not-a-subnet"}]]},
])
def test_rails_that_cannot_share_get_a_call_each(second):
    reqs = requests(host_local("fd00:1::/64"), second)
    calls = ipam.plan_calls(reqs, share=True)
    assert [(c.ifname, c.members) for c in calls] == [("rdma0", [0]), ("rdma1", [1])]


def test_sharing_groups_by_store_and_keeps_rail_order():
    reqs = requests(host_local("fd00:1::/64"), host_local("10.1.0.0/16", data_dir="/tmp/y"),
                    host_local("fd00:3::/64"), host_local("10.3.0.0/16", data_dir="/tmp/y"))
    calls = ipam.plan_calls(reqs, share=True)
    assert [(c.ifname, c.members) for c in calls] == [("rdma0", [0, 2]), ("rdma1", [1, 3])]


def test_recorded_holders_rebuild_the_same_calls_and_older_states_get_a_call_per_rail():
    states = [{"ifname": f"rdma{i}", "ipam": host_local(f"fd00:{i + 1}::/64")} for i in range(3)]
    ipam.hold_shared(states)
    assert [s["ipamHolder"] for s in states] == ["rdma0"] * 3
    (call,) = ipam.plan_calls(ipam.recorded(states), share=False)
    assert call.ifname == "rdma0" and call.members == [0, 1, 2]
    older = [{k: v for k, v in s.items() if k != "ipamHolder"} for s in states]
    assert [c.ifname for c in ipam.plan_calls(ipam.recorded(older), share=False)] == ["rdma0", "rdma1", "rdma2"]


def test_a_lone_rail_records_no_holder():
    states = [{"ifname": "rdma0", "ipam": host_local("fd00:1::/64")}]
    ipam.hold_shared(states)
    assert "ipamHolder" not in states[0]


def _call(n: int) -> ipam.Call:
    reqs = requests(*(host_local(f"fd00:{i + 1}::/64") for i in range(n)))
    (call,) = ipam.plan_calls(reqs, share=True)
    return call


def test_a_shared_answer_is_dealt_out_by_range_set():
    answer = {"cniVersion": "1.0.0", "ips": [{"address": f"fd00:{i + 1}::5/64", "gateway": f"fd00:{i + 1}::1"}
                                             for i in range(3)], "routes": [{"dst": "::/0"}], "dns": {}}
    parts = ipam._split("ADD", _call(3), execplugin.Finished(0, json.dumps(answer).encode(), b""), 5)
    assert [p["ips"] for p in parts] == [[ip] for ip in answer["ips"]]
    assert all(p["routes"] == [{"dst": "::/0"}] for p in parts)


def test_a_shared_answer_with_the_wrong_count_fails_every_rail():
    answer = {"ips": [{"address": "fd00:1::5/64"}]}
    parts = ipam._split("ADD", _call(3), execplugin.Finished(0, json.dumps(answer).encode(), b""), 5)
    assert all(isinstance(p, CniError) and "1 addresses for the 3 range sets" in p.msg for p in parts)


def test_a_shared_failure_names_the_rail_whose_range_failed():
    refusal = {"cniVersion": "1.0.0", "code": 11, "msg": "failed to allocate for range 2: no IP addresses available"}
    parts = ipam._split("ADD", _call(4), execplugin.Finished(1, json.dumps(refusal).encode(), b""), 5)
    assert all(isinstance(p, ipam.IpamRefused) for p in parts)
    assert "for rdma2 (in one call for rdma0, rdma1, rdma2, rdma3)" in parts[0].msg


# ---------------------------------------------------------------- with the real host-local


@pytest.fixture
def real(tmp_path):
    assert os.access(f"{HOST_LOCAL_DIR}/host-local", os.X_OK), "Debian's containernetworking-plugins is needed"
    return str(tmp_path)


def _run(command: str, reqs: list[ipam.Request], calls: list[ipam.Call], container: str = "c1") -> list:
    """`calls`: what plan_calls makes of `reqs`, which invoke_many runs (the tests check it first)."""
    assert [c.members for c in calls] == [c.members for c in ipam.plan_calls(reqs, share=False)]
    return ipam.invoke_many(command, reqs, network="rails", cni_version="1.0.0", container_id=container,
                            netns="/proc/self/ns/net", cni_path=[HOST_LOCAL_DIR], timeout=10)


def _leases(data_dir: str) -> dict[str, str]:
    folder = os.path.join(data_dir, "rails")
    return {name: open(os.path.join(folder, name), newline="").read() for name in os.listdir(folder)
            if ":" in name or name.count(".") == 3}


def test_real_host_local_serves_eight_rails_in_one_call_and_one_del_releases_them(real):
    states = [{"ifname": f"rdma{i}", "ipam": host_local(f"fd00:{i + 1}::/64", real)} for i in range(8)]
    ipam.hold_shared(states)
    reqs = ipam.recorded(states)
    calls = ipam.plan_calls(reqs, share=False)
    assert len(calls) == 1
    outcomes = _run("ADD", reqs, calls)
    assert [o["ips"][0]["address"].split("::")[0] for o in outcomes] == [f"fd00:{i + 1}" for i in range(8)]
    assert len(_leases(real)) == 8 and set(_leases(real).values()) == {"c1\r\nrdma0"}
    assert _run("CHECK", reqs, calls) == [None] * 8
    assert _run("DEL", reqs, calls) == [None] * 8
    assert _leases(real) == {}


def test_real_host_local_failure_of_one_rail_holds_nothing_and_names_it(real):
    full = host_local("fd00:3::/64", real, rangeStart="fd00:3::10", rangeEnd="fd00:3::10")
    other = ipam.Request(full, "other")
    assert not isinstance(_run("ADD", [other], ipam.plan_calls([other], share=False), "c0")[0], CniError)
    states = [{"ifname": f"rdma{i}", "ipam": full if i == 2 else host_local(f"fd00:{i + 1}::/64", real)}
              for i in range(4)]
    ipam.hold_shared(states)
    reqs = ipam.recorded(states)
    outcomes = _run("ADD", reqs, ipam.plan_calls(reqs, share=False))
    assert all(isinstance(o, ipam.IpamRefused) for o in outcomes)
    assert "for rdma2 (in one call" in outcomes[0].msg and "no IP addresses available" in outcomes[0].msg
    assert set(_leases(real).values()) == {"c0\r\nother"}  # the rails before it were released


def test_real_host_local_old_per_rail_leases_are_released_rail_by_rail(real):
    states = [{"ifname": f"rdma{i}", "ipam": host_local(f"fd00:{i + 1}::/64", real)} for i in range(3)]
    reqs = ipam.recorded(states)  # no holders: a state written before rails shared calls
    calls = ipam.plan_calls(reqs, share=False)
    assert len(calls) == 3
    _run("ADD", reqs, calls)
    assert sorted(_leases(real).values()) == ["c1\r\nrdma0", "c1\r\nrdma1", "c1\r\nrdma2"]
    _run("DEL", reqs, calls)
    assert _leases(real) == {}
