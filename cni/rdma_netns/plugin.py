"""The CNI commands: ADD, DEL, CHECK, STATUS, GC, VERSION.

Policy lives here; kernel access goes through kernel/, per-mode interface moves through
modes/, addresses and routing through addressing.py. Every ADD writes its state before the first
change, so that a crash at any point leaves a record DEL (or GC) can undo.
"""

from __future__ import annotations

import os
import stat
import sys
from _socket import AF_INET, AF_INET6

from rdma_netns import addressing, faults, gid_order, ipam, modes, pod_cdi, pod_info, rails
from rdma_netns.config import loader
from rdma_netns.config.netconf import NetConfig
from rdma_netns.grants_client import Grant
from rdma_netns.kernel import netns, rdma_sysfs, rtnl
from rdma_netns.kernel.netlink import NetlinkError, NetlinkSocket
from rdma_netns.spec import versions
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import (
    CHECK_FAILED,
    IFNAME_EXISTS,
    INCOMPATIBLE_VERSION,
    INVALID_CONFIG,
    INVALID_ENV,
    IO_FAILURE,
    IPAM_FAILED,
    KERNEL_REJECTED,
    NO_RDMA,
    NOT_AVAILABLE,
    RAIL_UNAVAILABLE,
    UNKNOWN_CONTAINER,
    CniError,
)
from rdma_netns.state import AttachmentState, StateStore


def log(message: str) -> None:
    """Runtimes keep a plugin's stderr in their logs; stdout is reserved for the result."""
    print(f"rdma-netns: {message}", file=sys.stderr)


def _open_pod_netns(path: str) -> int:
    try:
        fd = netns.open_netns(path)
    except FileNotFoundError:
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} does not exist") from None
    except netns.NotANetns:
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} is not a network namespace") from None
    except OSError as exc:
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} cannot be opened: {exc.strerror}") from None
    return _refuse_own_netns(fd, path)


def _refuse_own_netns(fd: int, path: str) -> int:
    """A pod namespace is never the plugin's own: pod-side work there would hit host interfaces."""
    home = netns.current_netns_fd()
    try:
        if netns.same_netns(fd, home):
            os.close(fd)
            raise CniError(INVALID_ENV, f"CNI_NETNS {path} is the plugin's own (host) namespace")
    finally:
        os.close(home)
    return fd


def _open_pod_netns_if_alive(path: str, strict: bool = True) -> int | None:
    """For teardown: the pod namespace if it still exists, else None (its links went with it).

    Refused, as on ADD and saying why: the plugin's own namespace (teardown there would delete
    host interfaces that happen to carry a pod-side name) and a path that is something else than
    a network namespace (a directory, a FIFO, another kind of namespace, a file with content).
    An empty regular file is a netns mount point whose namespace the runtime already unmounted:
    gone, like a missing path. strict=False (a path the state recorded at ADD, when it was a
    netns): whatever is there now, the pod's namespace is gone."""
    if not path:
        return None
    try:
        fd = netns.open_netns(path)
    except netns.NotANetns:
        if not strict or _is_empty_file(path):
            return None
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} is not a network namespace; DEL refuses to tear down "
                       "through it") from None
    except OSError:
        return None
    return _refuse_own_netns(fd, path)


def _is_empty_file(path: str) -> bool:
    """An empty regular file outside nsfs (namespace files look like empty files too)."""
    try:
        st = os.stat(path)
        nsfs = os.stat("/proc/thread-self/ns/net").st_dev
    except OSError:
        return True
    return stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_dev != nsfs


def _rail_routing(net: NetConfig, link: rtnl.Link) -> tuple[int, int]:
    """A rail's routing table and rule priority in the pod.

    The table is derived from the interface's index in the pod, which is unique there, so two
    attachments (even of different networks) in one pod never share a table, and teardown can
    find the table again from the link without trusting stored numbers.
    """
    return net.route_table_base + link.index, net.rule_priority_base


def _host_parent(sock: NetlinkSocket, rail: rails.Rail, mode: modes.Mode) -> rtnl.Link:
    """The rail's netdev in the host, up if the mode needs it so (shared: its pods' links follow it)."""
    link = rtnl.get_link(sock, rail.netdev)
    if link is None:
        raise CniError(RAIL_UNAVAILABLE, f"rail netdev {rail.netdev} does not exist in the host namespace")
    if link.flags & rtnl.IFF_LOOPBACK:
        raise CniError(RAIL_UNAVAILABLE, f"rail netdev {rail.netdev} is a loopback device, not a NIC")
    if mode.parent_must_be_up and not link.flags & rtnl.IFF_UP:
        raise CniError(RAIL_UNAVAILABLE, f"rail netdev {rail.netdev} is down")
    return link


# ---------------------------------------------------------------- ADD


def cmd_add(env: CniEnv, cfg: loader.Config, grant: Grant | None = None) -> dict:
    """grant: kubelet's answer for the pod when pairing is on (the pod holds at least one unit)."""
    net = cfg.net
    chained = cfg.prev_result is not None
    mode = modes.select(net, chained)
    granted_ids = grant.device_ids if grant is not None and mode.grant_names_devices else None
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
            _teardown_or_raise(previous, env, cfg)
            store.delete(env.container_id, env.ifname)
        pod_fd = _open_pod_netns(env.netns)
        try:
            with NetlinkSocket() as host_sock:
                if mode.configures_addresses:
                    prev = None
                    plan = rails.plan(net, env.ifname, cfg.runtime.device_id, chained, granted_ids)
                    if (cfg.runtime.mac or cfg.runtime.ips) and len(plan) != 1:
                        raise CniError(INVALID_CONFIG, "runtimeConfig mac/ips need a single-rail attachment")
                    for rail in plan:  # every IPAM plugin must be there before anything changes
                        ipam.find_plugin(rail.ipam["type"], env.path)
                    parents = [_host_parent(host_sock, rail, mode) for rail in plan]
                    rail_states = [r.to_state() | mode.prepare(r, p) for r, p in zip(plan, parents)]
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
                    _rollback(state, env, cfg, store)
                    raise
            faults.point("before-result")
            return result
        finally:
            os.close(pod_fd)


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
    """Tell the pod's containers about their rails (pod_cdi.py): the JSON file, and with pairing a
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


def _rollback(state: AttachmentState, env: CniEnv, cfg: loader.Config, store: StateStore) -> None:
    errors = _teardown(state, env, cfg, rollback=True)
    if errors:  # keep the state: a later DEL retries what is left
        log(f"rollback of {env.container_id}/{env.ifname} incomplete, DEL will finish it: {'; '.join(errors)}")
    else:
        store.delete(env.container_id, env.ifname)


def _add_rails(env: CniEnv, cfg: loader.Config, mode: modes.Mode, plan: list[rails.Rail],
               parents: list[rtnl.Link], host_sock: NetlinkSocket, pod_fd: int, state: AttachmentState) -> dict:
    net = cfg.net
    extra: dict[str, object] = {}  # what the IPAM delegate may use of the runtime's per-call keys
    if cfg.args:
        extra["args"] = cfg.args
    if cfg.runtime.ips:
        extra["runtimeConfig"] = {"ips": cfg.runtime.ips}
    ipam_results = []
    for i, (rail, rail_state) in enumerate(zip(plan, state.rails)):
        rail_state["ipamStarted"] = True  # from here on a rollback owes this rail an IPAM DEL
        try:
            ipam_results.append(
                ipam.invoke("ADD", ipam=rail.ipam, network=net.name, cni_version=cfg.cni_version,
                            container_id=env.container_id, netns=env.netns, ifname=rail.ifname,
                            cni_path=env.path, timeout=net.ipam_timeout, extra=extra))
        except ipam.IpamRefused:
            # It answered with a CNI error: it holds nothing for us, so the rollback's IPAM DEL is
            # a courtesy (the spec's), and its failure must not keep an attachment nobody can delete.
            rail_state["ipamRefused"] = True
            raise
        faults.point(f"ipam-{i}")
    addressings = [addressing.parse_ipam_result(r, rail.ifname) for r, rail in zip(ipam_results, plan)]
    for i, (rail, parent) in enumerate(zip(plan, parents)):
        mode.attach(host_sock, pod_fd, rail, parent, cfg.runtime.mac)
        faults.point(f"attached-{i}")
    links: list[rtnl.Link] = []
    # GID-producing changes (links up, link-local addresses, the pod's addresses) go to all rails in
    # lockstep under the node-wide GID order lock, until their GIDs are there: pods then get the same
    # GID index on every rail whose table has the same layout (gid_order.py). Routing comes after.
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
                _kernel_step(link, addressing.bring_up, pod_sock, link, plan_ip)
            if has_gids:
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
            _kernel_step(link, addressing.add_routing, pod_sock, link, plan_ip, *_rail_routing(net, link))
    return _result(env, cfg, plan, links, addressings)


def _kernel_step(link: rtnl.Link, step, *args) -> None:
    """One configuration step of a rail in the pod; the kernel's refusal becomes KERNEL_REJECTED."""
    try:
        step(*args)
    except NetlinkError as exc:
        raise CniError(KERNEL_REJECTED, f"configuring {link.name}: {exc.strerror}") from None


def _wait_for_gids(plan: list[rails.Rail], addressings: list[addressing.RailAddressing], timeout: float,
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
            rail = plan[rail_index]
            raise CniError(NO_RDMA, f"no RoCE v2 GID for {address} appeared on {device} port {port} "
                           f"(rail {rail.ifname} on {rail.netdev})", "is the netdev really the RoCE port of that device?")
        found[rail_index].append(index)
    return found


def _result(env: CniEnv, cfg: loader.Config, plan: list[rails.Rail], links: list[rtnl.Link],
            addressings: list[addressing.RailAddressing]) -> dict:
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


# ---------------------------------------------------------------- DEL and teardown


class TeardownErrors(list):
    """Teardown's failures (messages), knowing how many were IPAM's: when nothing else failed,
    the error is IPAM's (105), not the kernel's."""

    def __init__(self, errors: list[str], ipam_failures: int) -> None:
        super().__init__(errors)
        self.ipam_only = bool(errors) and ipam_failures == len(errors)


def _teardown(state: AttachmentState, env: CniEnv, cfg: loader.Config, rollback: bool = False) -> TeardownErrors:
    """Undo an attachment from its state: pod links and rules, then every rail's IPAM allocation.

    Goes on past failures so that one stuck rail does not strand the others; returns them.
    A rollback (same process as the failed ADD) knows which rails reached IPAM and releases
    only those; DEL and GC release every rail (IPAM DEL of nothing is a no-op).
    """
    net = cfg.net.with_recorded(state.teardown)
    mode = modes.for_state(state.mode, state.link, state.rails, net)
    pod_fd = _open_pod_netns_if_alive(state.netns or env.netns, strict=False)
    errors: list[str] = []
    host_fd = netns.current_netns_fd()
    try:
        if pod_fd is not None:
            with gid_order.Lockstep(net.state_dir, net.lock_timeout,
                                    active=any(r.get("rdmaDevice") for r in state.rails)), \
                    netns.inside(pod_fd), NetlinkSocket() as pod_sock:
                for rail in state.rails:
                    try:
                        _detach_rail(pod_sock, mode, rail, net, host_fd)
                    except (OSError, CniError) as exc:
                        errors.append(f"{rail.get('ifname')}: {getattr(exc, 'msg', exc)}")
        with NetlinkSocket() as host_sock:
            for rail in state.rails:
                problem = mode.restore_host(host_sock, rail)
                if problem:
                    log(f"teardown: {problem}")
    finally:
        os.close(host_fd)
        if pod_fd is not None:
            os.close(pod_fd)
    ipam_failures = 0
    for rail in state.rails:
        if not isinstance(rail.get("ipam"), dict) or (rollback and not rail.get("ipamStarted")):
            continue
        try:
            ipam.invoke("DEL", ipam=rail["ipam"], network=state.network or net.name,
                        cni_version=cfg.cni_version, container_id=state.container_id or env.container_id,
                        netns=state.netns or env.netns, ifname=rail["ifname"], cni_path=env.path,
                        timeout=net.ipam_timeout)
        except CniError as exc:
            if rollback and rail.get("ipamRefused"):
                log(f"IPAM DEL after a refused IPAM ADD failed too (ignored): {exc.msg}")
                continue
            errors.append(exc.msg)
            ipam_failures += 1
    for problem in pod_cdi.unpublish(state.published):  # never wedges a DEL; GC sweeps leftovers
        log(f"teardown: {problem}")
    return TeardownErrors(errors, ipam_failures)


def _teardown_or_raise(state: AttachmentState, env: CniEnv, cfg: loader.Config) -> None:
    errors = _teardown(state, env, cfg)
    if errors:
        code = IPAM_FAILED if errors.ipam_only else KERNEL_REJECTED
        raise CniError(code, "teardown incomplete: " + "; ".join(errors))


def _detach_rail(pod_sock: NetlinkSocket, mode: modes.Mode, rail: dict, net: NetConfig, host_fd: int) -> None:
    link = mode.find_in_pod(pod_sock, rail)
    if link is None:
        if mode.configures_addresses:
            _remove_orphan_rules(pod_sock, rail, net)
        else:
            mode.detach(pod_sock, None, rail, host_fd)  # nothing of its own in the pod but the device
        return
    if not mode.owns(link, rail):
        return
    table, priority = _rail_routing(net, link)
    for family in (AF_INET6, AF_INET):  # rules are not removed with the link
        stale = [r.src for r in rtnl.list_rules(pod_sock, family)
                 if r.table == table and r.priority == priority and r.src is not None]
        addressing.remove_rules(pod_sock, stale, table, priority)
    mode.detach(pod_sock, link, rail, host_fd)


def _remove_orphan_rules(pod_sock: NetlinkSocket, rail: dict, net: NetConfig) -> None:
    """The rail's pod interface is already gone (deleted, or its host NIC vanished and took its
    macvlan along), but policy rules outlive interfaces: remove ours by the recorded addresses."""
    ours = set(rail.get("addresses") or [])
    if not ours:
        return
    for family in (AF_INET6, AF_INET):
        for rule in rtnl.list_rules(pod_sock, family):
            if (rule.priority == net.rule_priority_base and rule.src is not None
                    and rule.src.address_text() in ours):
                addressing.remove_rules(pod_sock, [rule.src], rule.table, rule.priority)


def cmd_del(env: CniEnv, cfg: loader.Config) -> None:
    net = cfg.net
    # The runtime's CNI_NETNS is refused when unsafe even though teardown follows the state's path.
    fd = _open_pod_netns_if_alive(env.netns)
    if fd is not None:
        os.close(fd)
    store = StateStore(net.state_dir, net.name)
    store.prepare()
    with store.locked(env.container_id, env.ifname, net.lock_timeout):
        state = store.load(env.container_id, env.ifname)
        if state is not None and state.unreadable():
            log(f"DEL of {env.container_id}/{env.ifname}: {state.unreadable()}; undoing what the fields this "
                "version knows describe")
        if cfg.refused is not None:
            log(f"DEL of {env.container_id}/{env.ifname} with a config ADD would refuse ({cfg.refused}): "
                + ("tearing down from the attachment's state" if state is not None
                   else "no state, so nothing of this attachment is known to release"))
        if state is None:
            if store.is_released(env.container_id, env.ifname):
                return  # a repeated DEL (containerd sends two or three): everything is released
            if cfg.refused is None:  # a refused config cannot say what ADD would have taken
                for err in _teardown(_state_from_config(env, cfg), env, cfg):
                    log(f"DEL without state, ignored: {err}")
        else:
            _teardown_or_raise(state, env, cfg)
        store.mark_released(env.container_id, env.ifname)
        if state is not None:
            store.delete(env.container_id, env.ifname)


def _state_from_config(env: CniEnv, cfg: loader.Config) -> AttachmentState:
    """Without state, DEL still releases what the config says ADD would have taken."""
    net = cfg.net
    try:
        entries = rails.configured_rails(net)
    except CniError:
        entries = []
    names = rails.pod_ifnames(entries, env.ifname, cfg.prev_result is not None)
    mode = modes.for_config(net)
    return AttachmentState(mode=mode.name, link=mode.link_kind, container_id=env.container_id, ifname=env.ifname,
                           netns=env.netns, network=net.name, phase="",
                           rails=[{"ifname": name, "ipam": e.ipam or net.ipam}
                                  for name, e in zip(names, entries)])


# ---------------------------------------------------------------- CHECK


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
    pod_fd = _open_pod_netns(env.netns)
    try:
        gids: list[tuple[str, int, str]] = []
        with netns.inside(pod_fd), NetlinkSocket() as pod_sock:
            for rail in state.rails:
                gids += _check_rail(pod_sock, mode, rail, result, net)
        _check_gids(gids, pod_fd if mode.gids_in_pod else None)
    finally:
        os.close(pod_fd)
    for rail in (r for r in state.rails if r.get("ipam")):
        ipam.invoke("CHECK", ipam=rail["ipam"], network=net.name, cni_version=cfg.cni_version,
                    container_id=env.container_id, netns=env.netns, ifname=rail["ifname"], cni_path=env.path,
                    timeout=net.ipam_timeout)


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
    addressing.verify(pod_sock, link, plan_ip, *_rail_routing(net, link))
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


# ---------------------------------------------------------------- STATUS and GC


def _distinct_ipams(ipams: list[dict]) -> list[dict]:
    out: list[dict] = []
    for conf in ipams:
        if conf not in out:
            out.append(conf)
    return out


def cmd_status(env: CniEnv, cfg: loader.Config) -> None:
    """Can ADD work now? Rails present and up, kernel mode right, IPAM plugins there and ready."""
    net = cfg.net
    try:
        if net.resource_name and not _is_socket(net.pod_resources_socket):
            raise CniError(NOT_AVAILABLE, f"kubelet's PodResources socket {net.pod_resources_socket} is missing",
                           f"pairing with {net.resource_name} grants needs a running kubelet")
        plan = rails.plan(net, "eth0", None, False)
        with NetlinkSocket() as sock:
            mode = modes.select(net)
            for rail in plan:
                _host_parent(sock, rail, mode)
        for conf in _distinct_ipams([rail.ipam for rail in plan]):
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


def cmd_gc(env: CniEnv, cfg: loader.Config) -> None:
    """Release every attachment of this network that the runtime no longer lists."""
    if cfg.valid_attachments is None:
        raise CniError(INVALID_CONFIG, "GC needs cni.dev/valid-attachments in the config")
    net = cfg.net
    store = StateStore(net.state_dir, net.name)
    store.prepare()
    for container_id, ifname in store.attachments():
        if (container_id, ifname) in cfg.valid_attachments:
            continue
        with store.locked(container_id, ifname, net.lock_timeout):
            state = store.load(container_id, ifname)
            if state is None:
                continue
            log(f"GC: releasing {container_id}/{ifname}")
            stale_env = CniEnv(command="DEL", container_id=container_id, ifname=ifname,
                               netns=state.netns, path=env.path)
            errors = _teardown(state, stale_env, cfg)
            if errors:  # keep the state so that the next GC tries again
                log(f"GC of {container_id}/{ifname} incomplete: {'; '.join(errors)}")
            else:
                store.delete(container_id, ifname)
    for container_id, ifname in store.released():
        if (container_id, ifname) not in cfg.valid_attachments:
            store.clear_released(container_id, ifname)
    store.sweep_locks()  # lock files of calls killed while holding them
    keep = set(store.attachments()) | cfg.valid_attachments
    for path in pod_cdi.sweep(net.pod_info_dir, net.cdi_spec_dir, net.name, keep):
        log(f"GC: removed {path}")
    _gc_ipam(env, cfg, store)


def _gc_ipam(env: CniEnv, cfg: loader.Config, store: StateStore) -> None:
    """Pass GC on to 1.1-capable IPAM plugins, in their terms: IPAM knows each rail as its own
    attachment (containerID, rail ifname), so the runtime's list is translated rail by rail."""
    net = cfg.net
    valid: list[dict] = []
    ipams: list[dict] = []
    for container_id, ifname in store.attachments():
        state = store.load(container_id, ifname)
        for rail in state.rails if state is not None else []:
            valid.append({"containerID": container_id, "ifname": rail.get("ifname")})
            ipams.append(rail.get("ipam"))
    ipams.extend(e.ipam or net.ipam for e in (net.rails or []))
    if net.ipam:
        ipams.append(net.ipam)
    for conf in _distinct_ipams([c for c in ipams if c]):
        try:
            if ipam.speaks_1_1(conf, env.path, net.ipam_timeout):
                ipam.invoke("GC", ipam=conf, network=net.name, cni_version=cfg.cni_version, container_id="",
                            netns="", ifname="", cni_path=env.path, timeout=net.ipam_timeout,
                            extra={"cni.dev/valid-attachments": valid})
        except CniError as exc:
            log(f"GC: IPAM {conf.get('type')} GC failed: {exc.msg}")
