"""podresources.pod_device_ids against a real gRPC PodResources server on a unix socket (the
stand-in kubelet's): Get, the List fallbacks of older kubelets, unknown pods, and each failure."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from rdma_netns.kubelet.podresources import PodGrant, PodResourcesUnavailable, pod_device_ids
from tests.kubelet_standin import PodResourcesStandIn

R = "rdma/hca"


@pytest.fixture
def folder():
    path = Path(tempfile.mkdtemp(prefix="rnpr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(folder):
    with PodResourcesStandIn(folder / "pod-resources" / "kubelet.sock") as standin:
        standin.set_pod("ns", "p1", {"main": {R: ["hca-0007", "hca-0002"], "other/x": ["x1"]},
                                     "side": {R: ["hca-0002", "hca-0011"]}},
                        init_containers={"init": {R: ["hca-0001"]}})
        standin.set_pod("ns", "none", {"main": {"other/x": ["x2"]}})
        standin.set_pod("other", "p1", {"main": {R: ["hca-0999"]}})
        yield standin


def ask(kubelet, namespace="ns", name="p1", resource=R, timeout=2.0) -> PodGrant:
    return pod_device_ids(str(kubelet.socket), namespace, name, resource, timeout)


def test_get_gives_every_containers_ids_deduplicated_and_sorted(kubelet):
    grant = ask(kubelet)
    assert grant == PodGrant(True, ["hca-0001", "hca-0002", "hca-0007", "hca-0011"], "Get")
    assert kubelet.calls == [("Get", "ns", "p1")]


def test_only_the_asked_resource_and_namespace_count(kubelet):
    assert ask(kubelet, resource="other/x") == PodGrant(True, ["x1"], "Get")
    assert ask(kubelet, namespace="other") == PodGrant(True, ["hca-0999"], "Get")
    assert ask(kubelet, name="none") == PodGrant(True, [], "Get")


def test_unknown_pod_on_get_is_an_answer_not_an_error(kubelet):
    assert ask(kubelet, name="ghost") == PodGrant(False, [], "Get")
    # A name containing "disabled" must not be mistaken for the gate's message.
    assert ask(kubelet, name="disabled-pod") == PodGrant(False, [], "Get")
    assert [c[0] for c in kubelet.calls] == ["Get", "Get"]


@pytest.mark.parametrize("mode", ["disabled", "unimplemented"])
def test_older_kubelets_fall_back_to_list(kubelet, mode):
    kubelet.get_mode = mode
    assert ask(kubelet) == PodGrant(True, ["hca-0001", "hca-0002", "hca-0007", "hca-0011"], "List")
    assert ask(kubelet, namespace="other") == PodGrant(True, ["hca-0999"], "List")
    assert ask(kubelet, name="ghost") == PodGrant(False, [], "List")
    assert kubelet.calls[:2] == [("Get", "ns", "p1"), ("List", "", "")]


def test_missing_socket_is_unreachable_without_loading_grpc(folder):
    code = ("import sys\nfrom rdma_netns.kubelet.podresources import pod_device_ids, PodResourcesUnavailable\n"
            "assert 'grpc' not in sys.modules\n"
            f"try:\n    pod_device_ids({str(folder / 'nothing.sock')!r}, 'ns', 'p', 'rdma/hca', 0.5)\n"
            "except PodResourcesUnavailable as e:\n    print(e.kind)\n"
            "print('grpc' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["unreachable", "False"]


def test_socket_without_listener_is_unreachable(folder):
    path = folder / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # the file exists, nobody accepts: ECONNREFUSED
    s.close()
    started = time.monotonic()
    with pytest.raises(PodResourcesUnavailable) as err:
        pod_device_ids(str(path), "ns", "p", R, 2.0)
    assert err.value.kind == "unreachable"
    assert time.monotonic() - started < 1.0  # refused is known at once, not at the deadline


def test_stopped_kubelet_is_unreachable(kubelet):
    kubelet.stop()  # the socket file may stay behind, as after a kubelet crash
    with pytest.raises(PodResourcesUnavailable) as err:
        ask(kubelet)
    assert err.value.kind == "unreachable"


def test_slow_kubelet_is_a_timeout_within_the_deadline(kubelet):
    kubelet.delay = 1.5
    started = time.monotonic()
    with pytest.raises(PodResourcesUnavailable) as err:
        ask(kubelet, timeout=0.3)
    elapsed = time.monotonic() - started
    assert err.value.kind == "timeout"
    assert 0.29 <= elapsed < 0.9, elapsed  # well before the 1.5 s the kubelet would take


def test_the_deadline_covers_get_and_list_together(kubelet):
    kubelet.get_mode, kubelet.delay = "disabled", 0.3
    started = time.monotonic()
    with pytest.raises(PodResourcesUnavailable) as err:
        ask(kubelet, timeout=0.5)  # Get takes 0.3 s, List would need 0.3 s more
    assert err.value.kind == "timeout"
    assert time.monotonic() - started < 1.2  # the kind above already proves one shared deadline
    assert [c[0] for c in kubelet.calls] == ["Get", "List"]
    kubelet.delay = 0.1
    assert ask(kubelet, timeout=1.5).via == "List"  # 0.2 s in all fits


def test_other_kubelet_errors_are_failed(folder):
    def refuse(request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "Get": grpc.unary_unary_rpc_method_handler(refuse), "List": grpc.unary_unary_rpc_method_handler(refuse)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    path = folder / "k.sock"
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        with pytest.raises(PodResourcesUnavailable) as err:
            pod_device_ids(str(path), "ns", "p", R, 1.0)
        assert err.value.kind == "failed"
        assert "PERMISSION_DENIED" in err.value.message
    finally:
        server.stop(None).wait(5)


def test_list_fallback_failure_is_classified_too(kubelet):
    kubelet.get_mode = "unimplemented"
    kubelet.stop()
    with pytest.raises(PodResourcesUnavailable) as err:
        ask(kubelet)
    assert err.value.kind == "unreachable"


def test_bad_timeout_is_a_caller_bug(kubelet):
    with pytest.raises(ValueError):
        ask(kubelet, timeout=0)


def test_relative_socket_path_works(kubelet):
    cwd = os.getcwd()
    os.chdir(kubelet.socket.parent)
    try:
        assert pod_device_ids("kubelet.sock", "ns", "p1", R, 2.0).found
    finally:
        os.chdir(cwd)


# --- kubelet's rate limit ------------------------------------------------------------------------
def test_the_stand_in_applies_kubelets_bucket_by_default(kubelet):
    """Every kubelet rate-limits PodResources (100 QPS, burst 10, RESOURCE_EXHAUSTED "rejected by
    rate limit"), so the stand-in does unless a test turns it off; the client's constants match it."""
    from rdma_netns.kubelet import ratelimit
    from tests import kubelet_standin

    assert (ratelimit.KUBELET_QPS, ratelimit.KUBELET_BURST, ratelimit.KUBELET_REFUSAL) == (
        kubelet_standin.KUBELET_QPS, kubelet_standin.KUBELET_BURST, kubelet_standin.KUBELET_REFUSAL) == (
        100, 10, "rejected by rate limit")
    from rdma_netns.kubelet.api.podresources.v1 import api_pb2, api_pb2_grpc

    channel = grpc.insecure_channel(f"unix://{kubelet.socket}")
    stub = api_pb2_grpc.PodResourcesListerStub(channel)
    codes = []
    for _ in range(40):  # far faster than 100 a second: the burst, then refusals
        try:
            stub.List(api_pb2.ListPodResourcesRequest(), timeout=2)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
            assert exc.details() == "rejected by rate limit"
    channel.close()
    assert codes[:10] == ["OK"] * 10 and "RESOURCE_EXHAUSTED" in codes, codes
    assert len(kubelet.rejected) == codes.count("RESOURCE_EXHAUSTED")
    assert codes.count("OK") < 20


def _drain(kubelet) -> None:
    while kubelet.bucket.allow():
        pass


@pytest.mark.parametrize("mode", ["enabled", "disabled"])
def test_a_refused_call_is_retried_and_answered(kubelet, mode):
    """The CNI's direct path: another client emptied kubelet's bucket; the refusal is retried
    after a short pause, and the answer is the grant (never "not granted", never an error)."""
    kubelet.get_mode = mode
    _drain(kubelet)
    grant = ask(kubelet, timeout=1.0)
    assert grant.found and grant.device_ids == ["hca-0001", "hca-0002", "hca-0007", "hca-0011"]
    assert kubelet.rejected, "the bucket was empty: the first call must have been refused"


def test_refused_until_the_deadline_is_rate_limited_in_time(folder):
    def refuse(request, context):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "Get": grpc.unary_unary_rpc_method_handler(refuse), "List": grpc.unary_unary_rpc_method_handler(refuse)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    path = folder / "k.sock"
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        started = time.monotonic()
        with pytest.raises(PodResourcesUnavailable) as err:
            pod_device_ids(str(path), "ns", "p", R, 0.3)
        elapsed = time.monotonic() - started
        assert err.value.kind == "rate-limited" and "rejected by rate limit" in err.value.message
        assert 0.1 < elapsed < 0.6, elapsed  # retried, and given up inside the deadline
    finally:
        server.stop(None).wait(5)


def test_many_direct_callers_at_once_all_get_their_answer(kubelet):
    """64 CNI processes asking kubelet themselves at once (no broker): kubelet's bucket refuses
    most first calls; every caller still gets its grant inside a 2 s deadline."""
    for i in range(64):
        kubelet.set_pod("ns", f"q{i}", {"main": {R: [f"hca-{i:04d}"]}})
    with futures.ThreadPoolExecutor(64) as pool:
        grants = list(pool.map(lambda i: ask(kubelet, name=f"q{i}", timeout=2.0), range(64)))
    assert [g.device_ids for g in grants] == [[f"hca-{i:04d}"] for i in range(64)]
    assert kubelet.rejected, "64 calls at once must have met kubelet's limit"


def test_duplicate_list_entries_are_refused_not_merged(kubelet):
    kubelet.get_mode = "disabled"
    message = kubelet._message

    def renamed(namespace, name):
        entry = message(namespace, name)
        if (namespace, name) == ("ns", "none"):
            entry.name = "p1"  # a second ns/p1: the pod of that name being replaced
        return entry
    kubelet._message = renamed
    with pytest.raises(PodResourcesUnavailable) as err:
        ask(kubelet)
    assert err.value.kind == "ambiguous" and "ns/p1" in err.value.message and "2 times" in err.value.message


def test_token_bucket_waits_in_turn_and_never_past_the_deadline():
    from rdma_netns.kubelet.ratelimit import TokenBucket, backoff

    bucket = TokenBucket(qps=50, burst=2)
    now = time.monotonic()
    assert bucket.take(now) and bucket.take(now)  # the burst
    assert not bucket.take(time.monotonic() + 0.005)  # the next token is 20 ms away
    started = time.monotonic()
    assert bucket.take(started + 1.0)
    assert 0.015 < time.monotonic() - started < 0.2
    takes = 0
    started = time.monotonic()
    while time.monotonic() - started < 0.5:
        takes += bucket.take(started + 0.5)
    assert takes <= 0.5 * 50 + 2
    assert all(0.005 <= backoff(a) <= 0.04 for a in range(12))
    assert max(backoff(10) for _ in range(50)) > 0.03 > max(backoff(0) for _ in range(50))  # it grows
