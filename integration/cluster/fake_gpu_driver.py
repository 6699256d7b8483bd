"""A fake GPU DRA driver for the real-cluster DRA suite (test tooling, not the product): GPUs that
exist only as ResourceSlice devices with the standard resource.kubernetes.io/pcieRoot attribute,
registered with the node's kubelet through the plugin watcher, and preparing their claims with no
CDI device (a container gets nothing from them). What it lets the suite prove is the scheduler's
side: a claim for GPUs and rails with `matchAttribute: resource.kubernetes.io/pcieRoot` lands on
the rails under its GPUs' root, and an alignment no node has leaves the pod Pending.

It speaks kubelet's DRA API as a real driver must: same registration, same NodePrepareResources
answer shape (one Device per allocated result of this driver, with its request, pool and name).

  python -m integration.cluster.fake_gpu_driver --kubeconfig F --node N --gpus '[["gpu-0", "pci0000:10"], ...]'
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from concurrent import futures

import grpc

from rdma_netns_dp.api.dra.v1 import api_pb2 as dra_pb2
from rdma_netns_dp.api.dra.v1 import api_pb2_grpc as dra_grpc
from rdma_netns_dp.dra import kube_api
from rdma_netns_dp.dra.kube_api import ApiError, Credentials, KubeApi
from rdma_netns_dp.registration import WatcherRegistration, serve_watcher

DRIVER = "gpu.example.com"


def slice_for(node: str, gpus: list[tuple[str, str]]) -> dict:
    devices = [{"name": name, "attributes": {"resource.kubernetes.io/pcieRoot": {"string": root},
                                             "index": {"int": i}}} for i, (name, root) in enumerate(gpus)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-fake-gpus"},
            "spec": {"driver": DRIVER, "nodeName": node, "devices": devices,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}}


class Prepare(dra_grpc.DRAPluginServicer):
    def __init__(self, api: KubeApi) -> None:
        self.api = api

    def NodePrepareResources(self, request, context):
        out = dra_pb2.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                found = self.api.get(kube_api.resource_claims_path(claim.namespace, claim.name))
            except ApiError as exc:
                out.claims[claim.uid].error = str(exc)
                continue
            answer = out.claims[claim.uid]
            answer.SetInParent()
            for r in found["status"]["allocation"]["devices"]["results"]:
                if r["driver"] == DRIVER:
                    answer.devices.add(request_names=[r["request"]], pool_name=r["pool"], device_name=r["device"])
        return out

    def NodeUnprepareResources(self, request, context):
        out = dra_pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            out.claims[claim.uid].SetInParent()
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpus", required=True, help="JSON [[name, pcieRoot], ...]")
    parser.add_argument("--kubelet-dir", default="/var/lib/kubelet")
    args = parser.parse_args(argv)
    api = KubeApi(Credentials.from_kubeconfig(args.kubeconfig))
    body = slice_for(args.node, [tuple(g) for g in json.loads(args.gpus)])
    path = kube_api.resource_slices_path(body["metadata"]["name"])
    api.delete(path)
    api.create(kube_api.resource_slices_path(), body)
    endpoint = os.path.join(args.kubelet_dir, "plugins", DRIVER, "dra.sock")
    os.makedirs(os.path.dirname(endpoint), exist_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    dra_grpc.add_DRAPluginServicer_to_server(Prepare(api), server)
    if os.path.exists(endpoint):
        os.unlink(endpoint)
    server.add_insecure_port(f"unix://{endpoint}")
    server.start()
    registration_socket = os.path.join(args.kubelet_dir, "plugins_registry", f"{DRIVER}-reg.sock")
    registration = serve_watcher(WatcherRegistration(DRIVER, endpoint, plugin_type="DRAPlugin",
                                                     versions=["v1.DRAPlugin"]), registration_socket)
    print(f"fake GPU driver serving {endpoint}, {len(body['spec']['devices'])} GPUs", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    registration.stop(0)
    server.stop(0)
    for leftover in (registration_socket, endpoint):
        if os.path.exists(leftover):
            os.unlink(leftover)
    api.delete(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
