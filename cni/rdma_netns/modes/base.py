"""What the commands (commands/) ask of a mode: the protocol every mode implements.

An abstract base with empty __slots__ rather than typing.Protocol: the hot path does not import
`typing` (about 5 ms), and a base class also states the defaults. The commands never test a mode's
name; it reads these capabilities and calls these methods. A new mode is one module here that
subclasses Mode, plus its entry in modes/__init__.py (select/for_state) and the config model.
"""

from __future__ import annotations

from rdma_netns.config.netconf import NetConfig
from rdma_netns.kernel import rtnl
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.rails.nics import Rail


RDMA_DEVICE_LINK = "rdma-device"  # the state's "link" of rdma_device.RdmaDeviceMode (imported lazily)


class Mode:
    """One way of getting a rail into a pod and out again."""

    __slots__ = ()

    name = ""               # the state's "mode" (the kernel RDMA netns mode it runs in)
    link_kind = ""          # the state's "link": what the pod interface is
    parent_must_be_up = False   # ADD and STATUS refuse a rail whose host netdev is down
    gids_in_pod = False     # the RDMA devices live in the pod: GIDs are read through its sysfs view
    grant_names_devices = False  # pairing: the pod's granted units are the NICs to attach (else any
    # unit admits the pod to every rail)
    parent_stays_in_host = True  # the rail's host netdev (and the node's address on it) stays in the
    # host: rangeFromNodeAddress can derive the pod range from that address
    detach_deletes_link = False  # detach() is only the pod link's deletion: teardown deletes every
    # rail's link in one kernel step instead (rtnl.delete_links)
    configures_addresses = True  # False: IPAM, addresses and routes are the previous plugin's
    # (chained after a netdev plugin: the pod interface is not ours, the attachment passes the
    # previous result on; see chained_rails/attach_chained)

    def prepare(self, rail: Rail, parent: rtnl.Link) -> dict:
        """Facts to record in the rail's state before anything changes (what DEL restores)."""
        return {}

    def attach(self, host_sock: NetlinkSocket, pod_netns_fd: int, rail: Rail, parent: rtnl.Link,
               mac: str | None) -> None:
        raise NotImplementedError

    def chained_rails(self, ifname: str, prev: dict, net: NetConfig, device_id: str | None,
                      granted_ids: list[str] | None) -> list[dict]:
        """configures_addresses False only: the state's rails, from the previous result."""
        raise NotImplementedError

    def attach_chained(self, pod_netns_fd: int, rails: list[dict], prev: dict) -> None:
        """configures_addresses False only: attach, and note it in the previous result."""
        raise NotImplementedError

    def find_in_pod(self, pod_sock: NetlinkSocket, rail_state: dict) -> rtnl.Link | None:
        """The rail's pod interface (inside the pod), or None when it is gone."""
        return rtnl.get_link(pod_sock, rail_state["ifname"])

    def owns(self, link: rtnl.Link, rail_state: dict) -> bool:
        """Is `link` the interface this mode made (never a foreign one of the same name)?"""
        raise NotImplementedError

    def detach(self, pod_sock: NetlinkSocket, link: rtnl.Link | None, rail_state: dict,
               host_netns_fd: int) -> None:
        """Inside the pod: undo attach (link is None for a mode without its own pod interface)."""
        raise NotImplementedError

    def restore_host(self, host_sock: NetlinkSocket, rail_state: dict) -> str | None:
        """In the host, after detach (also when the pod's namespace is gone): a problem or None."""
        return None

    def check_in_pod(self, rail_state: dict) -> str | None:
        """CHECK of a rail without its own pod interface: what is wrong, or None."""
        return None
