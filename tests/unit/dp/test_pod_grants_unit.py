"""The grants broker's request checks, answer shapes and config key, without a daemon: a
PodGrantsServer on a socket under tmp, its kubelet query replaced by a function."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading

import pytest

from rdma_netns_dp.config import ConfigError, load
from rdma_netns_dp.pod_grants import BadRequest, PodGrantsServer, answer, parse_request
from rdma_netns.kubelet.podresources import PodGrant, PodResourcesUnavailable

GOOD = {"v": 1, "podResourcesSocket": "/var/lib/kubelet/pod-resources/kubelet.sock", "namespace": "ns",
        "name": "p", "uid": "0b6e", "resourceName": "rdma/hca", "timeoutMs": 500}


def test_good_request_passes_and_uid_is_optional():
    assert parse_request(json.dumps(GOOD).encode()) == GOOD
    without_uid = {k: v for k, v in GOOD.items() if k != "uid"}
    assert parse_request(json.dumps(without_uid).encode()) == without_uid


@pytest.mark.parametrize("change,needle", [
    ({"v": 2}, "version"), ({"podResourcesSocket": "kubelet.sock"}, "absolute"),
    ({"podResourcesSocket": "/a\u0000b"}, "absolute"), ({"timeoutMs": 10001}, "timeoutMs"),
    ({"timeoutMs": 2.5}, "timeoutMs"), ({"resourceName": ""}, "resourceName"), ({"uid": 5}, "uid"),
])
def test_bad_fields_say_which(change, needle):
    with pytest.raises(BadRequest, match=needle):
        parse_request(json.dumps({**GOOD, **change}).encode())


def test_answer_shapes_and_the_seconds_given_to_kubelet():
    seen = []

    def query(*args):
        seen.append(args)
        return PodGrant(True, ["a", "b"], "List")
    assert answer(GOOD, query) == {"v": 1, "found": True, "deviceIDs": ["a", "b"], "via": "List"}
    assert seen == [(GOOD["podResourcesSocket"], "ns", "p", "rdma/hca", 0.5)]
    assert answer(GOOD, lambda *a: PodGrant(False, [], "Get")) == {"v": 1, "found": False, "via": "Get"}

    def unavailable(*a):
        raise PodResourcesUnavailable("timeout", "slow")
    assert answer(GOOD, unavailable) == {"v": 1, "error": "timeout", "msg": "slow"}

    def bug(*a):
        raise KeyError("x")
    assert answer(GOOD, bug)["error"] == "failed"


def ask(path: str, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(payload)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return json.loads(data)


def test_server_answers_one_line_and_cleans_up(tmp_path):
    path = str(tmp_path / "run" / "pg.sock")
    calls = threading.Event()

    def query(*args):
        calls.set()
        return PodGrant(True, ["hca-0001"], "Get")
    server = PodGrantsServer(path, query).start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
        # The request may arrive in pieces; only the newline ends it.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            raw = json.dumps(GOOD).encode() + b"\n"
            s.sendall(raw[:10])
            s.sendall(raw[10:])
            assert s.makefile("rb").read() == b'{"v": 1, "found": true, "deviceIDs": ["hca-0001"], "via": "Get"}\n'
        assert calls.is_set()
        assert ask(path, b"x" * (64 * 1024 + 10))["error"] == "bad-request"
    finally:
        server.stop()
    assert not os.path.exists(path)


def test_config_key_default_off_and_checks(tmp_path):
    assert load(None, {}).podGrantsSocket == "/run/rdma-netns/pod-grants.sock"
    assert load(None, {"podGrantsSocket": ""}).podGrantsSocket == ""
    assert load(None, {"podGrantsSocket": "/run//x/../pg.sock"}).podGrantsSocket == "/run/pg.sock"
    config = tmp_path / "c.yaml"
    config.write_text("podGrantsSocket: /srv/pg.sock\n")
    assert load(str(config), {}).podGrantsSocket == "/srv/pg.sock"
    with pytest.raises(ConfigError, match="podGrantsSocket.*absolute"):
        load(None, {"podGrantsSocket": "pg.sock"})
    with pytest.raises(ConfigError, match="podGrantsSocket.*107"):
        load(None, {"podGrantsSocket": "/" + "a" * 107})
