"""The kubelet-facing v1beta1.DevicePlugin service of one resource (protobuf in, protobuf out)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from functools import partial

import grpc

from rdma_netns.kernel.rdma_devices import DeviceSysfs
from rdma_netns_dp import pod_cdi
from rdma_netns_dp.allocation import AllocationError, ContainerGrant, grant, pod_cdi_nodes
from rdma_netns_dp.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from rdma_netns_dp.inventory import HEALTHY, UNHEALTHY, Pool, Unit, UnknownDevice
from rdma_netns_dp.preferred import lowest_units, preferred

log = logging.getLogger("rdma_netns_dp.servicer")


def device_message(unit: Unit) -> api_pb2.Device:
    message = api_pb2.Device(ID=unit.id, health=HEALTHY if unit.healthy else UNHEALTHY)
    if unit.numa_node is not None:
        message.topology.nodes.add(ID=unit.numa_node)
    return message


def _response(g: ContainerGrant) -> api_pb2.ContainerAllocateResponse:
    out = api_pb2.ContainerAllocateResponse(envs=g.envs)
    for node in g.nodes:
        out.devices.add(container_path=node.container_path, host_path=node.host_path,
                        permissions=node.permissions)
    for name in g.cdi_devices:
        out.cdi_devices.add(name=name)
    return out


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, pool: Pool, sysfs: DeviceSysfs, dev_root: str, use_cdi: bool,
                 cdi_spec_dir: str = "/var/run/cdi") -> None:
        self.pool = pool
        self.sysfs = sysfs
        self.dev_root = dev_root
        self.use_cdi = use_cdi
        self.cdi_spec_dir = cdi_spec_dir
        self.stopping = threading.Event()

    def options(self) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def GetDevicePluginOptions(self, request, context):
        return self.options()

    def ListAndWatch(self, request, context) -> Iterator[api_pb2.ListAndWatchResponse]:
        version, units = self.pool.snapshot()
        log.info("ListAndWatch opened", extra={"resource": self.pool.resource.name, "devices": len(units)})
        yield api_pb2.ListAndWatchResponse(devices=[device_message(u) for u in units])
        while context.is_active() and not self.stopping.is_set():
            new_version, units = self.pool.wait_for_change(version, timeout=1.0)
            if new_version == version:
                continue
            version = new_version
            healthy = sum(1 for u in units if u.healthy)
            log.info("device list changed", extra={"resource": self.pool.resource.name,
                                                   "devices": len(units), "healthy": healthy})
            yield api_pb2.ListAndWatchResponse(devices=[device_message(u) for u in units])

    def GetPreferredAllocation(self, request, context):
        """Exclusive: fewest NUMA nodes; shared: the lowest-numbered units (preferred.py)."""
        response = api_pb2.PreferredAllocationResponse()
        choose = (partial(lowest_units, order=self.pool.unit_order()) if self.pool.shared
                  else partial(preferred, numa_of=self.pool.numa_of()))
        for req in request.container_requests:
            ids = choose(list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size)
            response.container_responses.add(deviceIDs=ids)
        return response

    def Allocate(self, request, context):
        resource = self.pool.resource
        response = api_pb2.AllocateResponse()
        for req in request.container_requests:
            try:
                devices = self.pool.devices_for(list(req.devices_ids))
                g = grant(devices, self.sysfs, self.dev_root, resource.name, resource.slug,
                          resource.includeUmad, self.use_cdi, skip_leaving=self.pool.shared)
            except UnknownDevice as exc:
                log.warning("Allocate refused", extra={"resource": resource.name, "reason": str(exc)})
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except AllocationError as exc:
                log.warning("Allocate failed", extra={"resource": resource.name, "reason": str(exc)})
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if not devices:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"{resource.name}: no selected RDMA device is on this node now")
            if resource.podCdi and self.pool.shared:
                self._pod_cdi(list(req.devices_ids), devices, g, context)
            response.container_responses.append(_response(g))
            log.info("Allocate", extra={"resource": resource.name, "ids": len(req.devices_ids),
                                        "rdma_devices": g.envs["RDMA_NETNS_DEVICES"]})
        return response

    def _pod_cdi(self, units: list[str], devices: list, g: ContainerGrant, context) -> None:
        """Name each unit's pod CDI device, with a placeholder spec until the pod's CNI ADD."""
        resource = self.pool.resource
        nodes = g.nodes
        if self.use_cdi:  # the grant names the resource's CDI devices instead of listing nodes
            nodes = grant(devices, self.sysfs, self.dev_root, resource.name, resource.slug, resource.includeUmad,
                          False, skip_leaving=True).nodes
        placeholder_nodes = pod_cdi_nodes(ContainerGrant(nodes=nodes))
        for unit in units:
            try:
                pod_cdi.ensure_placeholder(self.cdi_spec_dir, resource.podCdiKind, unit, placeholder_nodes)
            except (OSError, ValueError) as exc:
                log.warning("pod CDI placeholder failed", extra={"resource": resource.name, "reason": str(exc)})
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{resource.name}: cannot write the pod CDI spec of "
                              f"{unit}: {exc}")
            g.cdi_devices.append(f"{resource.podCdiKind}={unit}")

    def PreStartContainer(self, request, context):
        return api_pb2.PreStartContainerResponse()
