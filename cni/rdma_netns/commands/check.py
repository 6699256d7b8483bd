"""CHECK: the attachment is still what ADD made (interfaces, MACs, addresses, routing, GIDs)."""

from __future__ import annotations

import os

from rdma_netns import modes
from rdma_netns.commands.pod_netns import open_pod_netns
from rdma_netns.config import loader
from rdma_netns.config.netconf import NetConfig
from rdma_netns.kernel import netns, rdma_sysfs, rtnl
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.rails import addressing, ipam, nics
from rdma_netns.spec import versions
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import CHECK_FAILED, INCOMPATIBLE_VERSION, UNKNOWN_CONTAINER, CniError
from rdma_netns.state import StateStore


def cmd_check(env: CniEnv, cfg: loader.Config) -> None:
    if not versions.at_least(cfg.cni_version, "0.4.0"):
        raise CniError(INCOMPATIBLE_VERSION, f"CHECK needs cniVersion 0.4.0 or later, not {cfg.cni_version}")
    net = cfg.net
    store = StateStore(net.state_dir, net.name)
    store.prepare()
    with store.locked(env.container_id, env.ifname, net.lock_timeout):
        state = store.load(env.container_id, env.ifname)
    if state is None and cfg.prev_result is not None and net.resource_name \
            and store.is_released(env.container_id, env.ifname):
        return  # a pod not granted the resource: this network attached nothing, so nothing changed
    if state is None or state.phase != "ready" or state.result is None:
        raise CniError(UNKNOWN_CONTAINER, f"no attachment {env.container_id}/{env.ifname} in network {net.name}")
    problem = state.unreadable()
    if problem:
        raise CniError(INCOMPATIBLE_VERSION, f"the state of {env.container_id}/{env.ifname} has {problem}: it was "
                       "written by another rdma-netns version, which this one cannot CHECK",
                       "CHECK with the version that added it; DEL still works")
    mode = modes.for_state(state.mode, state.link, state.rails, net)
    result = state.result
    if cfg.prev_result is not None:
        listed = {i.get("name") for i in cfg.prev_result.get("interfaces", []) if i.get("sandbox")}
        for rail in state.rails:
            if rail["ifname"] not in listed:
                raise CniError(CHECK_FAILED, f"prevResult does not list the pod interface {rail['ifname']}")
    pod_fd = open_pod_netns(env.netns)
    try:
        gids: list[tuple[str, int, str]] = []
        with netns.inside(pod_fd), NetlinkSocket() as pod_sock:
            for rail in state.rails:
                gids += _check_rail(pod_sock, mode, rail, result, net)
        _check_gids(gids, pod_fd if mode.gids_in_pod else None)
    finally:
        os.close(pod_fd)
    requests = ipam.recorded([r for r in state.rails if r.get("ipam")])  # one CHECK per call ADD made
    for outcome in ipam.invoke_many("CHECK", requests, network=net.name,
                                    cni_version=cfg.cni_version, container_id=env.container_id, netns=env.netns,
                                    cni_path=env.path, timeout=net.ipam_timeout):
        if isinstance(outcome, CniError):
            raise outcome


def _check_rail(pod_sock: NetlinkSocket, mode: modes.Mode, rail: dict, result: dict,
                net: NetConfig) -> list[tuple[str, int, str]]:
    """Check one rail inside the pod; returns the (device, port, address) GIDs still to verify."""
    if not mode.configures_addresses:  # the pod interface is the previous plugin's
        problem = mode.check_in_pod(rail)
        if problem:
            raise CniError(CHECK_FAILED, problem)
        return []
    link = rtnl.get_link(pod_sock, rail["ifname"])
    if link is None:
        raise CniError(CHECK_FAILED, f"the pod has no interface {rail['ifname']}")
    if not mode.owns(link, rail):
        raise CniError(CHECK_FAILED, f"{rail['ifname']} is not the {mode.link_kind} this network set up")
    index = next(i for i, iface in enumerate(result["interfaces"]) if iface["name"] == rail["ifname"]
                 and iface.get("sandbox"))
    if result["interfaces"][index].get("mac") not in (None, link.mac):
        raise CniError(CHECK_FAILED, f"{rail['ifname']} changed its MAC to {link.mac}")
    plan_ip = addressing.parse_ipam_result(
        {"ips": [ip for ip in result["ips"] if ip.get("interface") == index], "routes": []}, rail["ifname"])
    addressing.verify(pod_sock, link, plan_ip, *nics.routing(net, link))
    if not rail.get("rdmaDevice"):
        return []
    return [(rail["rdmaDevice"], rail["port"], address.address_text()) for address, _gw in plan_ip.addresses]


def _check_gids(wanted: list[tuple[str, int, str]], pod_view_fd: int | None) -> None:
    if not wanted:
        return
    if pod_view_fd is None:
        indexes = rdma_sysfs.wait_for_gids(wanted, 0)
    else:
        from rdma_netns.kernel import netns_sysfs

        indexes = netns_sysfs.call_in_pod_view(pod_view_fd, lambda: rdma_sysfs.wait_for_gids(wanted, 0))
    for (device, _port, address), index in zip(wanted, indexes):
        if index is None:
            raise CniError(CHECK_FAILED, f"the RoCE v2 GID of {address} is gone from {device}")
