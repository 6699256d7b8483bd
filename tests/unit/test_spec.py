"""CNI spec layer: environment validation, versions, result formats, errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from rdma_netns.spec import versions
from rdma_netns.spec.env import is_normalised, parse_cni_args, read_env, valid_container_id, valid_ifname
from rdma_netns.spec.errors import CniError

BASE = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "abc", "CNI_NETNS": "/var/run/netns/x", "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin:/usr/lib/cni"}


@pytest.mark.parametrize("cid,ok", [("abc", True), ("a1_b.c-d", True), ("0" * 64, True), ("", False),
                                    ("-a", False), (".a", False), ("a/b", False), ("a b", False),
                                    ("é", False), ("a" * 257, False)])
def test_container_ids(cid, ok):
    assert valid_container_id(cid) is ok


@pytest.mark.parametrize("name,ok", [("eth0", True), ("a" * 15, True), ("a" * 16, False), ("", False),
                                     (".", False), ("..", False), ("a/b", False), ("a:b", False),
                                     ("a b", False), ("a\tb", False)])
def test_ifnames(name, ok):
    assert valid_ifname(name) is ok


def test_env_parsed():
    env = read_env(dict(BASE, CNI_ARGS="K8S_POD_NAME=p;IgnoreUnknown=1"))
    assert env.path == ["/opt/cni/bin", "/usr/lib/cni"]
    assert env.args == {"K8S_POD_NAME": "p", "IgnoreUnknown": "1"}


@pytest.mark.parametrize("override", [
    {"CNI_COMMAND": "add"}, {"CNI_NETNS": ""}, {"CNI_NETNS": "x"}, {"CNI_NETNS": "/a/../b"},
    {"CNI_NETNS": "/a//b"}, {"CNI_ARGS": "=x"},
])
def test_env_errors_are_invalid_env(override):
    with pytest.raises(CniError) as err:
        read_env(dict(BASE, **override))
    assert err.value.code == 4


def test_del_allows_empty_netns_and_version_needs_nothing():
    read_env(dict(BASE, CNI_COMMAND="DEL", CNI_NETNS=""))
    read_env({"CNI_COMMAND": "VERSION"})


def test_cni_args_tolerates_empty_pairs():
    assert parse_cni_args(";A=1;;B=;") == {"A": "1", "B": ""}


RESULT = {"cniVersion": "1.1.0", "interfaces": [{"name": "r0", "mac": "02:00:00:00:00:01", "sandbox": "/ns",
                                                  "pciID": "0000:3b:00.0", "mtu": 9000}],
          "ips": [{"address": "fd00::2/64", "gateway": "fd00::1", "interface": 0},
                  {"address": "10.0.0.2/24", "interface": 0}]}


@pytest.mark.parametrize("version", versions.SUPPORTED_VERSIONS)
def test_result_formats(version):
    out = versions.format_result(RESULT, version)
    assert out["cniVersion"] == version
    if version < "1.0.0":
        assert [ip["version"] for ip in out["ips"]] == ["6", "4"]
    else:
        assert all("version" not in ip for ip in out["ips"])
    has_11_fields = "pciID" in out["interfaces"][0]
    assert has_11_fields is (version == "1.1.0")


def test_versions_parse_and_compare():
    assert versions.at_least("1.1.0", "0.4.0") and not versions.at_least("0.3.1", "0.4.0")
    for bad in ("1.0", "a.b.c", "", None):
        with pytest.raises(CniError):
            versions.require_supported(bad)
    with pytest.raises(CniError) as err:
        versions.require_supported("0.2.0")
    assert err.value.code == 1


def test_error_json():
    err = CniError(7, "bad", "details here")
    assert err.to_json_dict("1.0.0") == {"cniVersion": "1.0.0", "code": 7, "msg": "bad", "details": "details here"}


@settings(max_examples=examples(3000), deadline=None)
@given(st.lists(st.sampled_from(["", ".", "..", "a", "b.c", "...", "net ns"]), max_size=6), st.integers(1, 3),
       st.booleans())
def test_netns_path_normalisation_is_posixpaths(parts, leading, trailing):
    """is_normalised (no posixpath on the hot path: it imports os) agrees with normpath(p) == p."""
    import posixpath

    path = "/" * leading + "/".join(parts) + ("/" if trailing else "")
    assert is_normalised(path) == (posixpath.normpath(path) == path), path
