"""ADD: resolve the rails, record the attachment, then IPAM, interfaces, addresses in GID order,
routing, and what the pod's containers are told (publish/pod_cdi.py). Any failure rolls back from the
record (teardown.py)."""

from __future__ import annotations

import posix

from rdma_netns import faults, modes
from rdma_netns.commands import log
from rdma_netns.commands.pod_netns import open_pod_netns
from rdma_netns.config import loader
from rdma_netns.config.netconf import NetConfig
from rdma_netns.grants.client import Grant
from rdma_netns.kernel import netns, rdma_sysfs, rtnl
from rdma_netns.kernel.netlink import NetlinkError, NetlinkSocket
from rdma_netns.publish import pod_cdi, pod_info
from rdma_netns.rails import ipam, nics
from rdma_netns.spec import versions
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import (
    IFNAME_EXISTS,
    INVALID_CONFIG,
    IO_FAILURE,
    KERNEL_REJECTED,
    NO_RDMA,
    CniError,
)
from rdma_netns.state import AttachmentState, StateStore

TYPE_CHECKING = False  # typing is not imported on the hot path
if TYPE_CHECKING:
    from rdma_netns.rails.addressing import RailAddressing  # loaded while IPAM runs (_load_after_ipam)


def cmd_add(env: CniEnv, cfg: loader.Config, grant: Grant | None = None) -> dict:
    """grant: kubelet's answer for the pod when pairing is on (the pod holds at least one unit)."""
    net = cfg.net
    chained = cfg.prev_result is not None
    mode = modes.select(net, chained)
    granted_ids = granted_rails(grant, mode)
    store = StateStore(net.state_dir, net.name)
    store.prepare()
    with store.locked(env.container_id, env.ifname, net.lock_timeout):
        store.clear_released(env.container_id, env.ifname)
        previous = store.load(env.container_id, env.ifname)
        if previous is not None:
            if previous.phase == "ready":
                raise CniError(IFNAME_EXISTS, f"attachment {env.container_id}/{env.ifname} already exists",
                               "DEL it before adding it again")
            log(f"cleaning up an interrupted ADD of {env.container_id}/{env.ifname}")
            from rdma_netns.commands.teardown import teardown_or_raise  # only for what went wrong

            teardown_or_raise(previous, env, cfg)
            store.delete(env.container_id, env.ifname)
        pod_fd = open_pod_netns(env.netns)
        try:
            with NetlinkSocket() as host_sock:
                if mode.configures_addresses:
                    prev = None
                    plan = nics.plan(net, env.ifname, cfg.runtime.device_id, chained, granted_ids)
                    if (cfg.runtime.mac or cfg.runtime.ips) and len(plan) != 1:
                        raise CniError(INVALID_CONFIG, "runtimeConfig mac/ips need a single-rail attachment")
                    for rail in plan:  # every IPAM plugin must be there before anything changes
                        ipam.find_plugin(rail.ipam["type"], env.path)
                    parents = [nics.host_parent(host_sock, rail, mode.parent_must_be_up) for rail in plan]
                    if any(rail.range_rule for rail in plan):
                        _node_ranges(mode, host_sock, plan, parents)
                    rail_states = [r.to_state() | mode.prepare(r, p) for r, p in zip(plan, parents)]
                    ipam.hold_shared(rail_states)
                else:  # chained after the plugin that made the pod interface: its result goes on
                    prev = versions.format_result(cfg.prev_result, versions.LATEST)
                    rail_states = mode.chained_rails(env.ifname, prev, net, cfg.runtime.device_id, granted_ids)
                state = _new_state(env, net, mode, rail_states)
                # What ADD will publish is in the first record, so a rollback or DEL removes it
                # from there (unpublish skips what is not there yet) at no extra state write.
                state.published = pod_cdi.plan(net.pod_info_dir, net.cdi_spec_dir, net.cdi_kind, env.container_id,
                                               env.ifname, grant.device_ids if grant is not None else [])
                store.save(env.container_id, env.ifname, state)
                faults.point("state-written")
                try:
                    if prev is None:
                        result = _add_rails(env, cfg, mode, plan, parents, host_sock, pod_fd, state)
                    else:
                        mode.attach_chained(pod_fd, state.rails, prev)
                        result = prev
                    _publish(net, mode, state, result, pod_fd)
                    faults.point("before-ready")
                    _save_ready(store, env, state, result)
                except BaseException:
                    from rdma_netns.commands.teardown import rollback  # a successful ADD never loads it

                    rollback(state, env, cfg, store)
                    raise
            faults.point("before-result")
            return result
        finally:
            posix.close(pod_fd)


def granted_rails(grant: Grant | None, mode: modes.Mode) -> list[str] | None:
    """The NICs the grant limits the pod to: a DRA claim's rails in every mode; the device
    plugin's units where they are NICs (exclusive); None: every configured rail."""
    if grant is None:
        return None
    if grant.rails is not None:
        return grant.rails
    return grant.device_ids if mode.grant_names_devices else None


def _node_ranges(mode: modes.Mode, host_sock: NetlinkSocket, plan: list[nics.Rail],
                 parents: list[rtnl.Link]) -> None:
    """rangeFromNodeAddress: each rail's pod range from the node's address on it, before anything
    changes (the state records the range the IPAM is asked for)."""
    if not mode.parent_stays_in_host:
        raise CniError(INVALID_CONFIG, f"rangeFromNodeAddress needs shared mode; the kernel's RDMA mode makes this "
                       f"attachment {mode.name}, which moves the NIC (and the node's address) into the pod")
    from rdma_netns.rails import node_range  # only configs that use it

    node_range.apply(host_sock, plan, parents)


def _new_state(env: CniEnv, net: NetConfig, mode: modes.Mode, rail_states: list[dict]) -> AttachmentState:
    """The record ADD writes before its first change."""
    return AttachmentState(mode=mode.name, link=mode.link_kind, container_id=env.container_id, ifname=env.ifname,
                           netns=env.netns, network=net.name, teardown=net.teardown_settings(), rails=rail_states)


def _save_ready(store: StateStore, env: CniEnv, state: AttachmentState, result: dict) -> None:
    """The attachment is complete; a failure to record that is rolled back like any other."""
    state.phase = "ready"
    state.result = result
    try:
        store.save(env.container_id, env.ifname, state)
    except BaseException:
        state.phase = "adding"
        raise


def _publish(net: NetConfig, mode: modes.Mode, state: AttachmentState, result: dict, pod_fd: int) -> None:
    """Tell the pod's containers about their rails (publish/pod_cdi.py): the JSON file, and with pairing a
    CDI spec per granted unit, as planned in the state's first record; a failure fails the ADD,
    whose rollback removes what was written."""
    published = state.published
    if published is None:
        return
    entries = [_rail_entry(rail, result) for rail in state.rails]
    record = pod_info.record(net.name, state.container_id, state.ifname, mode.name, entries)
    devices = [e["rdmaDevice"] for e in entries if e["rdmaDevice"]]
    nodes: list[dict] = []
    faults.point("publishing")
    try:
        if published["cdiSpecs"] and devices:
            nodes = pod_cdi.device_nodes(devices, _uverbs(pod_fd if mode.gids_in_pod else None))
        pod_cdi.publish(published, record, nodes)
    except OSError as exc:
        raise CniError(IO_FAILURE, f"cannot publish the pod's rail settings: {exc}") from None


def _rail_entry(rail: dict, result: dict) -> dict:
    """A rail of the pod info record: its addresses (with prefix length) from the result, its GID
    index from what ADD waited for (the first address's; null when unknown)."""
    index = next((i for i, iface in enumerate(result.get("interfaces", []))
                  if iface.get("name") == rail.get("ifname") and iface.get("sandbox")), None)
    addresses = [ip["address"] for ip in result.get("ips", []) if index is not None and ip.get("interface") == index]
    gids = rail.get("gidIndexes") or [None]
    return pod_info.rail_entry(rail.get("ifname") or "", rail.get("netdev"), addresses, rail.get("rdmaDevice"),
                               rail.get("port"), gids[0])


def _uverbs(pod_view_fd: int | None) -> dict[str, list]:
    """The uverbs char devices by RDMA device, as the host (or, exclusive, the pod) sees them."""
    if pod_view_fd is None:
        return rdma_sysfs.default.char_devices("infiniband_verbs")
    from rdma_netns.kernel import netns_sysfs

    found = netns_sysfs.call_in_pod_view(pod_view_fd, lambda: rdma_sysfs.default.char_devices("infiniband_verbs"))
    return found if isinstance(found, dict) else {}


def _add_rails(env: CniEnv, cfg: loader.Config, mode: modes.Mode, plan: list[nics.Rail],
               parents: list[rtnl.Link], host_sock: NetlinkSocket, pod_fd: int, state: AttachmentState) -> dict:
    net = cfg.net
    extra: dict[str, object] = {}  # what the IPAM delegate may use of the runtime's per-call keys
    if cfg.args:
        extra["args"] = cfg.args
    if cfg.runtime.ips:
        extra["runtimeConfig"] = {"ips": cfg.runtime.ips}
    # Every rail's IPAM delegate at once (separate processes, one time limit): on an 8-rail pod
    # they were most of ADD one after another. From here on a rollback owes each rail an IPAM DEL.
    for rail_state in state.rails:
        rail_state["ipamStarted"] = True

    def while_ipam_runs() -> None:
        """The rails' links need no address: they are made while the delegates run (a failure
        here still waits for them, then rolls back like any other), and the code of the steps
        after IPAM loads meanwhile."""
        faults.point("ipam-running")
        for i, (rail, parent) in enumerate(zip(plan, parents)):
            mode.attach(host_sock, pod_fd, rail, parent, cfg.runtime.mac)
            faults.point(f"attached-{i}")
        _load_after_ipam()

    requests = ipam.recorded(state.rails)  # rails alike share one host-local call (ipam.hold_shared)
    outcomes = ipam.invoke_many("ADD", requests, network=net.name,
                                cni_version=cfg.cni_version, container_id=env.container_id, netns=env.netns,
                                cni_path=env.path, timeout=net.ipam_timeout, extra=extra,
                                spawned_hook=while_ipam_runs)
    for rail_state, outcome in zip(state.rails, outcomes):
        if isinstance(outcome, ipam.IpamRefused):
            # It answered with a CNI error: it holds nothing for us, so the rollback's IPAM DEL is
            # a courtesy (the spec's), and its failure must not keep an attachment nobody can delete.
            rail_state["ipamRefused"] = True
    failed = next((o for o in outcomes if isinstance(o, CniError)), None)
    if failed is not None:  # the first failing rail's error (it names the rail); rollback releases all
        raise failed
    ipam_results = outcomes
    faults.point("ipam-done")
    from rdma_netns.rails import addressing, gid_order  # loaded while IPAM ran (_load_after_ipam)

    addressings = [addressing.parse_ipam_result(r, rail.ifname) for r, rail in zip(ipam_results, plan)]
    links: list[rtnl.Link] = []
    # GID-producing changes (links up, link-local addresses, the pod's addresses) go to all rails in
    # lockstep under the node-wide GID order lock, until their GIDs are there: pods then get the same
    # GID index on every rail whose table has the same layout (rails/gid_order.py). Routing comes after.
    has_gids = any(r.rdma is not None for r in plan)  # without an RDMA device no GID to order or wait for
    # One entry into the pod for all of it. The GID wait reads sysfs, whose view is the mount's
    # (the host's, or in exclusive mode the pod view a child mounts), not this thread's netns.
    with netns.inside(pod_fd), NetlinkSocket() as pod_sock:
        with gid_order.Lockstep(net.state_dir, net.lock_timeout, active=has_gids):
            for rail in plan:
                link = rtnl.get_link(pod_sock, rail.ifname)
                if link is None:
                    raise CniError(KERNEL_REJECTED, f"{rail.ifname} vanished from the pod right after it was created")
                links.append(link)
            for link, plan_ip in zip(links, addressings):
                _kernel_step(link, addressing.bring_up, pod_sock, link, plan_ip, net.link_local)
            if has_gids and net.link_local:
                gid_order.wait_for_link_local(pod_sock, links, net.gid_wait_ms / 1000)
            for i, (link, plan_ip) in enumerate(zip(links, addressings)):
                _kernel_step(link, addressing.add_addresses, pod_sock, link, plan_ip)
                # Kept so that DEL can still find this rail's policy rules if its interface vanishes.
                state.rails[i]["addresses"] = [address.address_text() for address, _gw in plan_ip.addresses]
                faults.point(f"addressed-{i}")
            gids = _wait_for_gids(plan, addressings, net.gid_wait_ms / 1000, pod_fd if mode.gids_in_pod else None)
        for rail_state, gid in zip(state.rails, gids):  # the GID order lock is released: routing needs no order
            rail_state["gidIndexes"] = gid
        for link, plan_ip in zip(links, addressings):
            _kernel_step(link, addressing.add_routing, pod_sock, link, plan_ip, *nics.routing(net, link))
    return _result(env, cfg, plan, links, addressings)


def _load_after_ipam() -> None:
    """What the steps after IPAM need (their modules, setns(2) from libc: ~1 ms of a cold
    process), loaded while the IPAM delegates run instead of before or after them."""
    from rdma_netns.rails import addressing, gid_order

    del addressing, gid_order  # imported for later: _add_rails imports them again at no cost
    netns.load_setns()


def _kernel_step(link: rtnl.Link, step, *args) -> None:
    """One configuration step of a rail in the pod; the kernel's refusal becomes KERNEL_REJECTED."""
    try:
        step(*args)
    except NetlinkError as exc:
        raise CniError(KERNEL_REJECTED, f"configuring {link.name}: {exc.strerror}") from None


def _wait_for_gids(plan: list[nics.Rail], addressings: list[RailAddressing], timeout: float,
                   pod_view_fd: int | None) -> list[list[int]]:
    """Each rail address must show up as a RoCE v2 GID of the rail's RDMA port (briefly awaited).

    pod_view_fd: in exclusive mode the RDMA devices live in the pod, and only a sysfs mounted
    there shows them, so the lookup runs in a child with that view.
    """
    wanted = [(rail.rdma.device, rail.rdma.port, address.address_text(), i)
              for i, (rail, plan_ip) in enumerate(zip(plan, addressings)) if rail.rdma is not None
              for address, _gw in plan_ip.addresses]
    if not wanted:
        return [[] for _ in plan]
    query = [w[:3] for w in wanted]
    if pod_view_fd is None:
        indexes = rdma_sysfs.wait_for_gids(query, timeout)
    else:
        from rdma_netns.kernel import netns_sysfs

        indexes = netns_sysfs.call_in_pod_view(pod_view_fd, lambda: rdma_sysfs.wait_for_gids(query, timeout))
    found: list[list[int]] = [[] for _ in plan]
    for (device, port, address, rail_index), index in zip(wanted, indexes):
        if index is None:
            raise _missing_gid(plan[rail_index], device, port, address, timeout, pod_view_fd)
        found[rail_index].append(index)
    return found


def _missing_gid(rail: nics.Rail, device: str, port: int, address: str, timeout: float,
                 pod_view_fd: int | None) -> CniError:
    """The error for a GID that did not appear, saying why as far as sysfs can tell: a full
    table (the kernel keeps the address and only logs error=-28), another GID type, or nothing."""
    def facts() -> dict:
        return rdma_sysfs.default.missing_gid_facts(device, port, address)

    try:
        if pod_view_fd is None:
            seen = facts()
        else:
            from rdma_netns.kernel import netns_sysfs

            seen = netns_sysfs.call_in_pod_view(pod_view_fd, facts)
    except (OSError, ValueError):
        seen = {}
    where = f"{device} port {port} (rail {rail.ifname} on {rail.netdev})"
    table = f"{seen.get('used', '?')}/{seen.get('total', '?')} entries used, {seen.get('perAddress', '?')} per address"
    if seen.get("full"):
        return CniError(NO_RDMA, f"GID table of {device} port {port} is full ({table}): the kernel kept "
                        f"{address} on rail {rail.ifname} but could not make it a GID",
                        "the node's pods use every entry of this port: wire fewer pods to it (the device "
                        "plugin stops offering units when a table fills), and leave \"linkLocal\" off "
                        "(a link-local address per rail takes entries too); rdma-netns devices shows each "
                        "port's use")
    if seen.get("otherTypes"):
        return CniError(NO_RDMA, f"{address} is a GID of {where} only as {', '.join(seen['otherTypes'])}, not "
                        f"RoCE v2 ({table})", "enable RoCE v2 on the port (mlx5: cma_roce_mode / devlink)")
    return CniError(NO_RDMA, f"no GID for {address} appeared on {where} within {timeout * 1000:.0f} ms; the "
                    f"port has {table}, none for this address",
                    f"the kernel fills {device}'s table from its own netdev, its bond, and the interfaces "
                    f"stacked on them: is {rail.netdev} one of those? (rdma-netns devices lists each device's "
                    "netdev and bond); a slow device may need a longer \"gidWaitMs\"")


def _result(env: CniEnv, cfg: loader.Config, plan: list[nics.Rail], links: list[rtnl.Link],
            addressings: list[RailAddressing]) -> dict:
    prev = versions.format_result(cfg.prev_result, versions.LATEST) if cfg.prev_result else {}
    interfaces = list(prev.get("interfaces", []))
    ips = list(prev.get("ips", []))
    routes = list(prev.get("routes", []))
    dns = prev.get("dns") or cfg.net.dns or {}
    for rail, link, plan_ip in zip(plan, links, addressings):
        iface = {"name": rail.ifname, "mac": link.mac, "sandbox": env.netns}
        if rail.rdma is not None:
            iface["pciID"] = rdma_sysfs.pci_address_of_device(rail.rdma.device) or rail.rdma.device
        if rail.mtu:
            iface["mtu"] = rail.mtu
        interfaces.append(iface)
        for address, gw in plan_ip.addresses:
            ip = {"address": str(address), "interface": len(interfaces) - 1}
            if gw is not None:
                ip["gateway"] = gw.address_text()
            ips.append(ip)
        routes.extend({"dst": str(dst), **({"gw": gw.address_text()} if gw else {})} for dst, gw in plan_ip.routes)
        if not dns and plan_ip.dns:
            dns = plan_ip.dns
    result = {"cniVersion": versions.LATEST, "interfaces": interfaces, "ips": ips}
    if routes:
        result["routes"] = routes
    if dns:
        result["dns"] = dns
    return result
