"""DEL, and the teardown that DEL, ADD's rollback and GC share: undo an attachment from its
record alone (pod links and rules, the mode's host-side restore, IPAM, published files), going on
past failures so that one stuck rail does not strand the others."""

from __future__ import annotations

import os
from _socket import AF_INET, AF_INET6

from rdma_netns import modes
from rdma_netns.commands import log
from rdma_netns.commands.pod_netns import open_pod_netns_if_alive
from rdma_netns.config import loader
from rdma_netns.config.netconf import NetConfig
from rdma_netns.kernel import netns, rtnl
from rdma_netns.kernel.netlink import NetlinkSocket, is_missing
from rdma_netns.publish import pod_cdi
from rdma_netns.rails import addressing, gid_order, ipam, nics
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import IPAM_FAILED, KERNEL_REJECTED, CniError
from rdma_netns.state import AttachmentState, StateStore


def cmd_del(env: CniEnv, cfg: loader.Config) -> None:
    net = cfg.net
    # The runtime's CNI_NETNS is refused when unsafe even though teardown follows the state's path.
    fd = open_pod_netns_if_alive(env.netns)
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
                for err in teardown(_state_from_config(env, cfg), env, cfg):
                    log(f"DEL without state, ignored: {err}")
        else:
            teardown_or_raise(state, env, cfg)
        store.mark_released(env.container_id, env.ifname)
        if state is not None:
            store.delete(env.container_id, env.ifname)


def _state_from_config(env: CniEnv, cfg: loader.Config) -> AttachmentState:
    """Without state, DEL still releases what the config says ADD would have taken."""
    net = cfg.net
    try:
        entries = nics.configured_rails(net)
    except CniError:
        entries = []
    names = nics.pod_ifnames(entries, env.ifname, cfg.prev_result is not None)
    mode = modes.for_config(net)
    # A rail whose ranges come from the node's address has no IPAM config to send without its
    # recorded one; and with no state, ADD never reached IPAM (the state is written first).
    return AttachmentState(mode=mode.name, link=mode.link_kind, container_id=env.container_id, ifname=env.ifname,
                           netns=env.netns, network=net.name, phase="",
                           rails=[{"ifname": name,
                                   "ipam": None if net.range_rule(e) else e.ipam or net.ipam}
                                  for name, e in zip(names, entries)])


def rollback(state: AttachmentState, env: CniEnv, cfg: loader.Config, store: StateStore) -> None:
    errors = teardown(state, env, cfg, rolling_back=True)
    if errors:  # keep the state: a later DEL retries what is left
        log(f"rollback of {env.container_id}/{env.ifname} incomplete, DEL will finish it: {'; '.join(errors)}")
    else:
        store.delete(env.container_id, env.ifname)


class TeardownErrors(list):
    """Teardown's failures (messages), knowing how many were IPAM's: when nothing else failed,
    the error is IPAM's (105), not the kernel's."""

    def __init__(self, errors: list[str], ipam_failures: int) -> None:
        super().__init__(errors)
        self.ipam_only = bool(errors) and ipam_failures == len(errors)


def teardown(state: AttachmentState, env: CniEnv, cfg: loader.Config, rolling_back: bool = False) -> TeardownErrors:
    """Undo an attachment from its state: pod links and rules, then every rail's IPAM allocation.

    Goes on past failures so that one stuck rail does not strand the others; returns them.
    A rollback (same process as the failed ADD) knows which rails reached IPAM and releases
    only those; DEL and GC release every rail (IPAM DEL of nothing is a no-op).
    """
    net = cfg.net.with_recorded(state.teardown)
    mode = modes.for_state(state.mode, state.link, state.rails, net)
    pod_fd = open_pod_netns_if_alive(state.netns or env.netns, strict=False)
    errors: list[str] = []
    host_fd = netns.current_netns_fd()
    try:
        if pod_fd is not None:
            with gid_order.Lockstep(net.state_dir, net.lock_timeout,
                                    active=any(r.get("rdmaDevice") for r in state.rails)), \
                    netns.inside(pod_fd), NetlinkSocket() as pod_sock:
                doomed: list[tuple[dict, rtnl.Link]] = []  # links the mode deletes, all in one step
                for rail in state.rails:
                    try:
                        link = _detach_rail(pod_sock, mode, rail, net, host_fd)
                        if link is not None:
                            doomed.append((rail, link))
                    except (OSError, CniError) as exc:
                        errors.append(f"{rail.get('ifname')}: {getattr(exc, 'msg', exc)}")
                errors.extend(_delete_links(pod_sock, doomed))
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
    owed = [rail for rail in state.rails
            if isinstance(rail.get("ipam"), dict) and not (rolling_back and not rail.get("ipamStarted"))]
    # Every rail's IPAM DEL at once (as ADD's), one time limit for all.
    requests = ipam.recorded(owed)  # a shared call's rails are released by one DEL, as ADD made them
    outcomes = ipam.invoke_many("DEL", requests, network=state.network or net.name, cni_version=cfg.cni_version,
                                container_id=state.container_id or env.container_id,
                                netns=state.netns or env.netns, cni_path=env.path,
                                timeout=net.ipam_timeout) if owed else []
    reported: set[int] = set()
    for rail, outcome in zip(owed, outcomes):
        if not isinstance(outcome, CniError) or id(outcome) in reported:
            continue  # a shared call's failure is one failure, said once
        reported.add(id(outcome))
        if rolling_back and rail.get("ipamRefused"):
            log(f"IPAM DEL after a refused IPAM ADD failed too (ignored): {outcome.msg}")
            continue
        errors.append(outcome.msg)
        ipam_failures += 1
    for problem in pod_cdi.unpublish(state.published):  # never wedges a DEL; GC sweeps leftovers
        log(f"teardown: {problem}")
    return TeardownErrors(errors, ipam_failures)


def teardown_or_raise(state: AttachmentState, env: CniEnv, cfg: loader.Config) -> None:
    errors = teardown(state, env, cfg)
    if errors:
        code = IPAM_FAILED if errors.ipam_only else KERNEL_REJECTED
        raise CniError(code, "teardown incomplete: " + "; ".join(errors))


def _detach_rail(pod_sock: NetlinkSocket, mode: modes.Mode, rail: dict, net: NetConfig,
                 host_fd: int) -> rtnl.Link | None:
    """Undo one rail in the pod; the link still to delete when the mode's detach is a plain
    deletion (left to _delete_links, which takes every rail's at once)."""
    link = mode.find_in_pod(pod_sock, rail)
    if link is None:
        if mode.configures_addresses:
            _remove_orphan_rules(pod_sock, rail, net)
        else:
            mode.detach(pod_sock, None, rail, host_fd)  # nothing of its own in the pod but the device
        return None
    if not mode.owns(link, rail):
        return None
    table, priority = nics.routing(net, link)
    for family in (AF_INET6, AF_INET):  # rules are not removed with the link
        stale = [r.src for r in rtnl.list_rules(pod_sock, family)
                 if r.table == table and r.priority == priority and r.src is not None]
        addressing.remove_rules(pod_sock, stale, table, priority)
    if mode.detach_deletes_link:
        return link
    mode.detach(pod_sock, link, rail, host_fd)
    return None


def _delete_links(pod_sock: NetlinkSocket, doomed: list[tuple[dict, rtnl.Link]]) -> list[str]:
    """Delete the rails' links in one kernel step (their routes and addresses go with them):
    each deletion waits for an RCU grace period, a group deletion waits once. A link whose group
    cannot be set, or a group deletion the kernel refuses, falls back to deleting one by one."""
    errors: list[str] = []
    if len(doomed) > 1:
        try:
            rtnl.delete_links(pod_sock, [link.index for _rail, link in doomed])
            return errors
        except OSError as exc:
            log(f"teardown: deleting the rails' links together failed ({exc}); one by one")
    for rail, link in doomed:
        try:
            rtnl.delete_link(pod_sock, link.index)
        except OSError as exc:
            if not is_missing(exc):
                errors.append(f"{rail.get('ifname')}: {getattr(exc, 'msg', exc)}")
    return errors


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
