"""Shared RDMA mode: each rail becomes a macvlan (or ipvlan) of the RDMA netdev, in the pod.

In shared mode every namespace sees every RDMA device; what makes the pod's RDMA traffic its
own is the address: the kernel adds a RoCE v2 GID for each address on an upper device of the
RoCE netdev, also in other namespaces, and rdma_cm picks the GID whose ndev is the pod's.
"""

from __future__ import annotations

import errno

from rdma_netns.kernel import rtnl
from rdma_netns.kernel.netlink import NetlinkError, NetlinkSocket
from rdma_netns.modes.base import Mode
from rdma_netns.rails.nics import Rail
from rdma_netns.spec.errors import IFNAME_EXISTS, INVALID_CONFIG, KERNEL_REJECTED, CniError


class SharedMode(Mode):
    __slots__ = ("link_kind", "link_mode")

    name = "shared"
    parent_must_be_up = True  # its pods' links follow the parent's carrier
    detach_deletes_link = True

    def __init__(self, link_kind: str, link_mode: str) -> None:
        self.link_kind = link_kind
        self.link_mode = link_mode

    def attach(self, host_sock: NetlinkSocket, pod_netns_fd: int, rail: Rail, parent: rtnl.Link,
               mac: str | None) -> None:
        """Create the rail's sub-interface directly inside the pod namespace."""
        if mac and self.link_kind == "ipvlan":
            raise CniError(INVALID_CONFIG, "runtimeConfig.mac cannot be honoured: ipvlan shares its parent's MAC")
        try:
            rtnl.create_sublink(host_sock, kind=self.link_kind, mode=self.link_mode, parent_index=parent.index,
                                name=rail.ifname, netns_fd=pod_netns_fd, mtu=rail.mtu or 0, mac=mac)
        except NetlinkError as exc:
            if exc.errno == errno.EEXIST:
                raise CniError(IFNAME_EXISTS, f"the pod already has an interface named {rail.ifname}") from None
            if exc.errno == errno.EOPNOTSUPP:
                raise CniError(KERNEL_REJECTED, f"this kernel cannot create {self.link_kind} links (built without "
                               f"{self.link_kind}, or its module is missing)") from None
            raise CniError(KERNEL_REJECTED, f"cannot create {self.link_kind} {rail.ifname} on {rail.netdev}: "
                           f"{exc.strerror}") from None

    def owns(self, link: rtnl.Link, rail_state: dict) -> bool:
        """Only sub-interfaces of our kind are ours to delete: never a moved or foreign netdev."""
        return link.kind == self.link_kind

    def detach(self, pod_sock: NetlinkSocket, link: rtnl.Link | None, rail_state: dict,
               host_netns_fd: int) -> None:
        if link is not None:
            rtnl.delete_link(pod_sock, link.index)
