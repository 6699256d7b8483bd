"""Exclusive RDMA mode: the rail's netdev and its RDMA device move into the pod, and back on DEL.

In exclusive mode a namespace sees only the RDMA devices moved into it, so the pod gets the
whole NIC: the netdev (renamed to the rail's ifname; the host name is kept in the state) and
the RDMA device (NETLINK_RDMA SET with NET_NS_FD). Moving back needs the calling thread inside
the pod namespace, with the RDMA socket opened there (the kernel answers ENODEV otherwise);
teardown runs the pod part inside the pod for that reason.
"""

from __future__ import annotations

import errno
import time

from rdma_netns import faults
from rdma_netns.kernel import rdma_sysfs, rtnl
from rdma_netns.kernel.netlink import NetlinkError, NetlinkSocket
from rdma_netns.modes.base import Mode
from rdma_netns.rails.nics import Rail
from rdma_netns.spec.errors import IFNAME_EXISTS, INVALID_CONFIG, KERNEL_REJECTED, RAIL_UNAVAILABLE, CniError

# Link kinds a NIC handed to a pod can have: none for PCI functions, veth in tests. Kinds that
# copy a parent's MAC (vlan, macvlan, ipvlan) are never mistaken for the NIC.
PHYSICAL_KINDS = ("", "veth")
NIC_RETURN_WAIT = 5.0  # seconds DEL waits for a physical NIC from a deleted pod namespace


def bond_refused(rail: Rail) -> CniError:
    """Exclusive mode cannot hand a pod a bond rail (RoCE LAG): the kernel refuses to move a bond
    to another namespace (bonding sets NETIF_F_NETNS_LOCAL), and moving a member instead breaks the
    LAG and takes the LAG's RDMA device (mlx5_bond_N) away with it."""
    members = rdma_sysfs.bond_members(rail.netdev)
    device = f", RDMA device {rail.rdma.device}" if rail.rdma else ""
    return CniError(RAIL_UNAVAILABLE, f"rail {rail.netdev} is a bond (over {', '.join(members) or 'no members'}"
                    f"{device}): exclusive mode moves a rail's netdev into the pod, and the kernel never moves a "
                    "bond to another namespace; moving a member would break the LAG",
                    "use shared mode for RoCE LAG rails (RDMA netns mode shared; \"mode\": \"shared\"): each "
                    "pod gets a macvlan or ipvlan of the bond")


class ExclusiveMode(Mode):
    __slots__ = ()

    name = "exclusive"
    link_kind = "netdev"
    gids_in_pod = True  # a namespace sees only the RDMA devices moved into it
    grant_names_devices = True
    parent_stays_in_host = False  # the NIC itself moves into the pod

    def prepare(self, rail: Rail, parent: rtnl.Link) -> dict:
        """What DEL needs to put the NIC back exactly, recorded before anything moves."""
        if parent.kind == "bond":
            raise bond_refused(rail)
        return {"hostName": parent.name, "hostMac": parent.mac, "hostUp": bool(parent.flags & rtnl.IFF_UP),
                "hostKind": parent.kind, "rdmaDevice": rail.rdma.device if rail.rdma else None}

    def attach(self, host_sock: NetlinkSocket, pod_netns_fd: int, rail: Rail, parent: rtnl.Link,
               mac: str | None) -> None:
        if mac:
            raise CniError(INVALID_CONFIG, "runtimeConfig.mac cannot be honoured in exclusive mode: the pod gets "
                                           "the NIC itself, with its own MAC")
        try:
            rtnl.move_link(host_sock, parent.index, pod_netns_fd, rail.ifname)
        except NetlinkError as exc:
            if exc.errno == errno.EEXIST:
                raise CniError(IFNAME_EXISTS, f"the pod already has an interface named {rail.ifname}") from None
            raise CniError(KERNEL_REJECTED, f"cannot move {rail.netdev} into the pod: {exc.strerror}") from None
        faults.point(f"netdev-moved-{rail.ifname}")
        if rail.rdma is not None:
            move_rdma_device(rail.rdma.device, pod_netns_fd)

    def owns(self, link: rtnl.Link, rail_state: dict) -> bool:
        """The pod interface is ours to hand back only if it is the very NIC we moved in."""
        return link.mac == rail_state.get("hostMac")

    def find_in_pod(self, pod_sock: NetlinkSocket, rail_state: dict) -> rtnl.Link | None:
        """The moved NIC, by MAC: a move can land half-way (in the pod under its host name when
        the rename there failed), and teardown must find it whatever it is called."""
        mac = rail_state.get("hostMac")
        if not mac or mac == "00:00:00:00:00:00":  # no identity to find it by (and lo has this MAC)
            return None
        return next((lk for lk in rtnl.list_links(pod_sock) if lk.mac == mac and lk.kind in PHYSICAL_KINDS),
                    None)

    def detach(self, pod_sock: NetlinkSocket, link: rtnl.Link | None, rail_state: dict,
               host_netns_fd: int) -> None:
        """Inside the pod: the RDMA device goes back first, then the netdev under its host name."""
        if rail_state.get("rdmaDevice"):
            move_rdma_device(rail_state["rdmaDevice"], host_netns_fd, missing_ok=True)
        if link is None:
            return
        try:
            rtnl.move_link(pod_sock, link.index, host_netns_fd, rail_state["hostName"])
        except NetlinkError as exc:
            if exc.errno != errno.EEXIST:
                raise
            # The host reused the name meanwhile. The kernel may already have moved the NIC
            # (the rename is the step that failed); if it is still here, bring it home under a
            # name that cannot clash. restore_host() reports the name it came back with.
            if rtnl.get_link(pod_sock, link.name) is not None:
                rtnl.move_link(pod_sock, link.index, host_netns_fd, f"rnx{link.index}"[:15])

    def restore_host(self, host_sock: NetlinkSocket, rail_state: dict) -> str | None:
        """In the host: find the NIC by MAC (its name may be the pod's, or dev<N>, when the pod's
        namespace died before DEL), give back its name and state. Returns a problem, or None."""
        name, mac = rail_state.get("hostName"), rail_state.get("hostMac")
        if not name or not mac:
            return None
        # A physical NIC whose pod namespace was deleted comes back when the kernel's namespace
        # cleanup runs, which is asynchronous (and slow on a loaded node): wait for it a little. A
        # NIC moved back from a live pod is already here, and a virtual one (veth) never comes back
        # (it dies with the namespace), so neither waits.
        wait = NIC_RETURN_WAIT if rail_state.get("hostKind", "") == "" else 0.0
        deadline = time.monotonic() + wait
        while (link := self._find_by_mac(host_sock, mac)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if link is None:
            return f"{name} ({mac}) is not back in the host namespace" + (f" after {wait:g} s" if wait else "")
        if link.name != name:
            rtnl.set_link_up(host_sock, link.index, False)
            try:
                rtnl.rename_link(host_sock, link.index, name)
            except NetlinkError as exc:
                return f"{name} came back as {link.name} and cannot be renamed: {exc.strerror}"
        if rail_state.get("hostUp"):
            rtnl.set_link_up(host_sock, link.index)
        return None

    @staticmethod
    def _find_by_mac(host_sock: NetlinkSocket, mac: str) -> rtnl.Link | None:
        return next((lk for lk in rtnl.list_links(host_sock) if lk.mac == mac and lk.kind in PHYSICAL_KINDS), None)


def rdma_device_visible(device: str) -> bool:
    """Is the RDMA device visible in the caller's current namespace (NETLINK_RDMA GET)?"""
    from rdma_netns.kernel import rdma_nldev  # only exclusive mode talks NETLINK_RDMA

    with NetlinkSocket(rdma_nldev.NETLINK_RDMA) as sock:
        return rdma_nldev.device_index(sock, device) is not None


def move_rdma_device(device: str, netns_fd: int, missing_ok: bool = False) -> None:
    """Move an RDMA device (by name, looked up in the caller's current namespace) to `netns_fd`."""
    from rdma_netns.kernel import rdma_nldev  # only exclusive mode talks NETLINK_RDMA

    with NetlinkSocket(rdma_nldev.NETLINK_RDMA) as sock:
        index = rdma_nldev.device_index(sock, device)
        if index is None:
            if missing_ok:
                return
            raise CniError(KERNEL_REJECTED, f"RDMA device {device} is not visible in this namespace")
        try:
            rdma_nldev.move_device(sock, index, netns_fd)
        except OSError as exc:
            raise CniError(KERNEL_REJECTED, f"cannot move RDMA device {device}: {exc}") from None
