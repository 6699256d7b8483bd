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
