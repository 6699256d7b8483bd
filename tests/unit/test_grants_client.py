"""The CNI side of the grants broker: every way an answer can go wrong is a clear 107.

A scripted broker (a thread on a unix socket) answers with what each test wants; the real broker
(rdma_netns_dp.pod_grants) is exercised end to end in tests/netns/test_pairing.py and tests/dp.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rdma_netns.commands import pairing
from rdma_netns.config.netconf import NetConfig
from rdma_netns.grants import client as grants_client
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import CniError


class ScriptedBroker:
    """Accepts connections and answers each with `reply(request_bytes)` (None: close silently)."""

    def __init__(self, reply: Callable[[bytes], bytes | None]) -> None:
        self.folder = tempfile.mkdtemp(prefix="rngc-", dir="/tmp")
        self.path = os.path.join(self.folder, "b.sock")
        self.requests: list[dict] = []
        self.reply = reply
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(json.loads(data))
                answer = self.reply(data)
                if answer is not None:
                    try:
                        conn.sendall(answer)
                    except OSError:
                        pass  # the client hung up first (an early question it dropped)

    def close(self) -> None:
        self.sock.close()
        os.unlink(self.path)
        os.rmdir(self.folder)


@pytest.fixture
def broker_with() -> Iterator[Callable[[Callable[[bytes], bytes | None]], ScriptedBroker]]:
    made: list[ScriptedBroker] = []

    def make(reply: Callable[[bytes], bytes | None]) -> ScriptedBroker:
        made.append(ScriptedBroker(reply))
        return made[-1]

    yield make
    for b in made:
        b.close()


def net(broker: str, timeout_ms: int = 300) -> NetConfig:
    return NetConfig({"name": "n", "stateDir": "/nonexistent", "resourceName": "rdma/hca",
                      "podResourcesSocket": "/var/lib/kubelet/pod-resources/kubelet.sock",
                      "podResourcesTimeoutMs": timeout_ms, "podGrantsSocket": broker})


def test_request_carries_the_pod_and_the_answer_comes_back(broker_with):
    b = broker_with(lambda _: b'{"v": 1, "found": true, "deviceIDs": ["hca-0001"], "via": "Get"}\n')
    grant = grants_client.query(net(b.path), "team-a", "trainer", "uid-1")
    assert (grant.found, grant.device_ids, grant.via) == (True, ["hca-0001"], "Get")
    assert b.requests == [{"v": 1, "podResourcesSocket": "/var/lib/kubelet/pod-resources/kubelet.sock",
                           "namespace": "team-a", "name": "trainer", "uid": "uid-1",
                           "resourceName": "rdma/hca", "timeoutMs": 300}]


@pytest.mark.parametrize("answer,words", [
    (b'{"v": 1, "error": "unreachable", "msg": "no kubelet at /x"}\n', "unreachable: no kubelet at /x"),
    (b'{"v": 1, "error": "timeout", "msg": "kubelet took longer than 300 ms"}\n', "timeout"),
    (b"not json\n", "no JSON answer"),
    (b"[1, 2]\n", "no JSON answer"),
    (b'{"v": 1, "found": true, "deviceIDs": [1, 2]}\n', "malformed device list"),
])
def test_broker_failures_are_107_with_the_reason(broker_with, answer, words):
    b = broker_with(lambda _: answer)
    with pytest.raises(CniError) as err:
        grants_client.query(net(b.path), "ns", "pod", "")
    assert err.value.code == 107 and words in err.value.msg


def test_a_silent_broker_times_out(broker_with):
    b = broker_with(lambda _: (time.sleep(2), None)[1])
    started = time.monotonic()
    with pytest.raises(CniError) as err:
        grants_client.query(net(b.path, timeout_ms=100), "ns", "pod", "")
    assert err.value.code == 107 and "did not answer" in err.value.msg
    assert time.monotonic() - started < 1.0


def test_oversized_answer_is_refused(broker_with):
    b = broker_with(lambda _: b"[" + b"1," * (grants_client.MAX_ANSWER // 2 + 10) + b"1]\n")
    with pytest.raises(CniError) as err:
        grants_client.query(net(b.path), "ns", "pod", "")
    assert err.value.code == 107 and "oversized" in err.value.msg


def test_a_broker_that_hangs_up_means_asking_kubelet_directly(broker_with):
    """A daemon being terminated (a rolling update) may accept and close without a word: the plugin
    then asks kubelet itself, and gets the grant (found in a rollout of the DaemonSet, issue 22)."""
    from tests.kubelet_standin import PodResourcesStandIn

    b = broker_with(lambda _: None)
    folder = tempfile.mkdtemp(prefix="rgk-", dir="/tmp")
    try:
        with PodResourcesStandIn(f"{folder}/kubelet.sock") as kubelet:
            kubelet.set_pod("ns", "pod", {"main": {"rdma/hca": ["hca-0007"]}})
            conf = net(b.path, timeout_ms=2000)
            conf.pod_resources_socket = f"{folder}/kubelet.sock"
            grant = grants_client.query(conf, "ns", "pod", "")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert (grant.found, grant.device_ids) == (True, ["hca-0007"]) and grant.via != ""
    assert b.requests, "the broker was asked first"


def test_no_broker_means_asking_kubelet_directly(tmp_path):
    """No broker socket: the plugin asks kubelet itself, here a kubelet that is not there either."""
    conf = net(str(tmp_path / "absent.sock"))
    conf.pod_resources_socket = str(tmp_path / "no-kubelet.sock")
    with pytest.raises(CniError) as err:
        grants_client.query(conf, "ns", "pod", "")
    assert err.value.code == 107 and "unreachable" in err.value.msg and "no-kubelet.sock" in err.value.msg


def test_without_a_broker_kubelets_rate_limit_is_waited_out_not_reported(tmp_path):
    """The direct path (no broker) meets kubelet's bucket emptied by other clients: the refusal is
    retried inside podResourcesTimeoutMs and the grant comes back; refused until the deadline, it is
    a clear 107 that says so (never "not granted")."""
    from tests.kubelet_standin import PodResourcesStandIn

    folder = tempfile.mkdtemp(prefix="rngk-", dir="/tmp")
    try:
        with PodResourcesStandIn(os.path.join(folder, "kubelet.sock")) as kubelet:
            kubelet.set_pod("ns", "pod", {"main": {"rdma/hca": ["hca-0003"]}})
            conf = net(os.path.join(folder, "absent.sock"), timeout_ms=1000)
            conf.pod_resources_socket = str(kubelet.socket)
            kubelet.bucket.qps = 5  # a node busier than the 100 a second: a token every 200 ms
            while kubelet.bucket.allow():
                pass
            grant = grants_client.query(conf, "ns", "pod", "")
            assert (grant.found, grant.device_ids) == (True, ["hca-0003"])
            assert kubelet.rejected
            kubelet.bucket.qps = 0.001  # nothing more for a long while
            while kubelet.bucket.allow():
                pass
            conf.pod_resources_timeout_ms = 200
            with pytest.raises(CniError) as err:
                grants_client.query(conf, "ns", "pod", "")
            assert err.value.code == 107 and "rate-limited" in err.value.msg and "rate limit" in err.value.msg
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_pairing_rules():
    env = CniEnv("ADD", "c1", "/var/run/netns/p", "eth0", {"IgnoreUnknown": "1"})
    assert pairing.granted(env, NetConfig({"name": "n", "stateDir": "/x"})) is None
    with pytest.raises(CniError) as err:
        pairing.granted(env, net("/nonexistent"))
    assert err.value.code == 4
    none = grants_client.Grant(True, [], "Get")
    some = grants_client.Grant(True, ["hca-0000"], "Get")
    assert pairing.attaches_nothing(none, chained=True, resource="rdma/hca")
    assert not pairing.attaches_nothing(some, chained=False, resource="rdma/hca")
    assert not pairing.attaches_nothing(None, chained=False, resource="rdma/hca")
    with pytest.raises(CniError) as err:
        pairing.attaches_nothing(none, chained=False, resource="rdma/hca")
    assert err.value.code == 108


# ---- the early question (grants/early.py): asked before validation, its answer taken only when
# the validated config asks the very same question of the very same broker


def raw_config(broker: str, **extra) -> dict:
    return {"cniVersion": "1.0.0", "name": "n", "type": "rdma-netns", "resourceName": "rdma/hca",
            "podGrantsSocket": broker, **extra}


POD_ARGS = {"K8S_POD_NAMESPACE": "team-a", "K8S_POD_NAME": "trainer", "K8S_POD_UID": "uid-1"}
GRANTED = b'{"v": 1, "found": true, "deviceIDs": ["hca-0001"], "via": "Get"}\n'
NOT_GRANTED = b'{"v": 1, "found": true, "deviceIDs": [], "via": "Get"}\n'


def validated(broker: str, **extra) -> NetConfig:
    """What the loader makes of raw_config (the model's defaults filled in)."""
    from rdma_netns.config.loader import validate_with_model

    return NetConfig(validate_with_model(raw_config(broker, **extra)))


def test_the_early_question_is_the_one_asked_and_its_answer_is_used(broker_with):
    from rdma_netns.grants import early as grants_early

    b = broker_with(lambda _: GRANTED)
    early = grants_early.send(raw_config(b.path), POD_ARGS)
    assert early is not None
    deadline = time.monotonic() + 2
    while not b.requests and time.monotonic() < deadline:  # asked before anything was validated
        time.sleep(0.01)
    assert len(b.requests) == 1
    grant = grants_client.query(validated(b.path), "team-a", "trainer", "uid-1", early)
    assert (grant.found, grant.device_ids) == (True, ["hca-0001"])
    assert len(b.requests) == 1, "the early answer was used, not a second question"
    assert b.requests[0] == {"v": 1, "podResourcesSocket": "/var/lib/kubelet/pod-resources/kubelet.sock",
                             "namespace": "team-a", "name": "trainer", "uid": "uid-1",
                             "resourceName": "rdma/hca", "timeoutMs": 2000}


def test_an_early_question_that_differs_is_dropped_and_asked_again(broker_with):
    """The validated config asks something else (here: another pod UID): the early answer is not
    taken, whatever it says, and the right question is asked."""
    from rdma_netns.grants import early as grants_early

    b = broker_with(lambda data: GRANTED if b'"uid-2"' in data else b'{"v": 1, "found": false, "via": "Get"}\n')
    early = grants_early.send(raw_config(b.path), POD_ARGS)
    grant = grants_client.query(validated(b.path), "team-a", "trainer", "uid-2", early)
    assert grant.device_ids == ["hca-0001"]
    assert [r["uid"] for r in b.requests] == ["uid-1", "uid-2"]
    assert early.sock is None


def test_early_question_only_for_values_validation_takes_as_they_are(broker_with, tmp_path):
    from rdma_netns.grants import early as grants_early

    b = broker_with(lambda _: GRANTED)
    assert grants_early.send(raw_config(b.path, podResourcesTimeoutMs=True), POD_ARGS) is None
    assert grants_early.send(raw_config(b.path, podResourcesTimeoutMs=0), POD_ARGS) is None
    assert grants_early.send(raw_config("relative.sock"), POD_ARGS) is None
    assert grants_early.send(raw_config(b.path, resourceName=""), POD_ARGS) is None
    assert grants_early.send(raw_config(b.path), {"K8S_POD_NAMESPACE": "ns"}) is None
    assert grants_early.send(raw_config(str(tmp_path / "absent.sock")), POD_ARGS) is None
    assert b.requests == []


def test_a_refused_config_drops_the_early_question(broker_with, tmp_path):
    """The whole CNI call: the config fails validation after the question left; the call reports the
    config error (7), the broker saw the question and a hang-up, and nothing was attached."""
    from rdma_netns.entry import run_cni

    b = broker_with(lambda _: (time.sleep(0.05), GRANTED)[1])
    conf = raw_config(b.path, stateDir=str(tmp_path / "state"), eventsFifo="", mode="shared",
                      rails=[{"netdev": "nonexistent0", "ipam": {"type": "host-local"}}], unknownKey=1)
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/var/run/netns/none",
           "CNI_IFNAME": "net1", "CNI_PATH": "/usr/lib/cni",
           "CNI_ARGS": "K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=trainer;K8S_POD_UID=uid-1"}
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run_cni(env, json.dumps(conf).encode())
    assert rc == 1
    assert json.loads(out.getvalue())["code"] == 7
    deadline = time.monotonic() + 2
    while not b.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(b.requests) == 1


FRESH_PROBE = """
import sys
at_connect = []
sys.addaudithook(lambda event, args: at_connect.append(sorted(m for m in ("os", "posixpath", "_collections_abc")
                                                              if m in sys.modules))
                 if event == "socket.connect" else None)
sys.path.insert(0, sys.argv[1])
from rdma_netns import entry
env = dict(zip(sys.argv[2::2], sys.argv[3::2]))
rc = entry.run_cni(env, sys.stdin.buffer.read())
sys.stderr.write("AT_CONNECT %r RC %d\\n" % (at_connect[:1], rc))
sys.stderr.write("AT_END %r\\n" % sorted(m for m in ("os", "posixpath", "_collections_abc") if m in sys.modules))
"""


def test_the_grants_question_leaves_before_os_is_imported_and_a_pod_not_granted_never_loads_it(broker_with, tmp_path):
    """A fresh interpreter, as the launcher runs it (-IS): the question is on its way before the
    ~1 ms import of os, so the broker works meanwhile; the call then completes as usual."""
    import subprocess
    import sys as _sys

    import rdma_netns

    b = broker_with(lambda _: NOT_GRANTED)
    conf = raw_config(b.path, stateDir=str(tmp_path / "state"), eventsFifo="", mode="shared",
                      prevResult={"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/x"}],
                                  "ips": [{"address": "10.0.0.2/24", "interface": 0}]},
                      rails=[{"netdev": "eth9", "ipam": {"type": "host-local"}}])
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/var/run/netns/none",
           "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni",
           "CNI_ARGS": "K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=web;K8S_POD_UID=uid-1"}
    packages = os.path.dirname(os.path.dirname(rdma_netns.__file__))

    def fresh_add(cid: str) -> tuple[list[str], bytes]:
        proc = subprocess.run([_sys.executable, "-IS", "-c", FRESH_PROBE, packages,
                               *[item for pair in dict(env, CNI_CONTAINERID=cid).items() for item in pair]],
                              input=json.dumps(conf).encode(), capture_output=True, timeout=60)
        lines = proc.stderr.decode().splitlines()
        assert "AT_CONNECT [[]] RC 0" in lines, proc.stderr.decode() + proc.stdout.decode()
        return lines, proc.stdout

    fresh_add("c1")  # the config's first call validates it (pydantic, which loads os), then its verdict is cached
    lines, stdout = fresh_add("c2")
    # Every later call: a pod that asked for no RDMA is passed through without os at all (util/paths.py).
    assert "AT_END []" in lines, lines
    assert json.loads(stdout)["ips"][0]["address"] == "10.0.0.2/24" and len(b.requests) == 2
