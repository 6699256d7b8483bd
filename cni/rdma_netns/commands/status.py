"""STATUS: can ADD work now?"""

from __future__ import annotations

import os
import stat

from rdma_netns import modes
from rdma_netns.config import loader
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.rails import ipam, nics
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import NOT_AVAILABLE, CniError


def cmd_status(env: CniEnv, cfg: loader.Config) -> None:
    """Can ADD work now? Rails present and up, kernel mode right, IPAM plugins there and ready."""
    net = cfg.net
    try:
        if net.resource_name and not _is_socket(net.pod_resources_socket):
            raise CniError(NOT_AVAILABLE, f"kubelet's PodResources socket {net.pod_resources_socket} is missing",
                           f"pairing with {net.resource_name} grants needs a running kubelet")
        plan = nics.plan(net, "eth0", None, False)
        with NetlinkSocket() as sock:
            mode = modes.select(net)
            parents = [nics.host_parent(sock, rail, mode.parent_must_be_up) for rail in plan]
            if any(rail.range_rule for rail in plan):  # a rail without its node address cannot take pods
                from rdma_netns.rails import node_range

                node_range.apply(sock, plan, parents)
        for conf in ipam.distinct([rail.ipam for rail in plan]):
            if ipam.speaks_1_1(conf, env.path, net.ipam_timeout):
                ipam.invoke("STATUS", ipam=conf, network=net.name, cni_version=cfg.cni_version, container_id="",
                            netns="", ifname="", cni_path=env.path, timeout=net.ipam_timeout)
    except CniError as exc:
        raise CniError(NOT_AVAILABLE, exc.msg, exc.details) from None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
