"""GC: release what the runtime no longer lists, sweep what killed calls left, pass GC on to IPAM."""

from __future__ import annotations

from rdma_netns.commands import log
from rdma_netns.commands.teardown import teardown
from rdma_netns.config import loader
from rdma_netns.publish import pod_cdi
from rdma_netns.rails import ipam
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import INVALID_CONFIG, CniError
from rdma_netns.state import StateStore


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
            errors = teardown(state, stale_env, cfg)
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
    # A rail whose ranges come from the node's address (rangeFromNodeAddress) is known to IPAM only
    # through the states' recorded configs: its config entry has no ranges to send.
    ipams.extend(e.ipam or net.ipam for e in (net.rails or []) if net.range_rule(e) is None)
    if net.ipam and not net.node_range:
        ipams.append(net.ipam)
    for conf in ipam.distinct([c for c in ipams if c]):
        try:
            if ipam.speaks_1_1(conf, env.path, net.ipam_timeout):
                ipam.invoke("GC", ipam=conf, network=net.name, cni_version=cfg.cni_version, container_id="",
                            netns="", ifname="", cni_path=env.path, timeout=net.ipam_timeout,
                            extra={"cni.dev/valid-attachments": valid})
        except CniError as exc:
            log(f"GC: IPAM {conf.get('type')} GC failed: {exc.msg}")
