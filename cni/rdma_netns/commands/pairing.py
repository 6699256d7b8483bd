"""Pairing with the device plugin: which pods get RDMA, and which NICs, is kubelet's decision.

With "resourceName" set, ADD asks kubelet (PodResources API, see grants/client.py) which units of
that resource the pod's containers were granted at admission, which happens before the runtime
creates the pod's network:
- shared mode: any unit means the pod gets its rails; none means nothing is attached, and a
  chained plugin hands the previous result back unchanged (the pod keeps its cluster network);
- exclusive mode: the unit IDs are the NICs (PCI address or RDMA device name) to move;
- a DRA node (the daemon's broker answers from the claims its DRA driver prepared): the claims'
  rails are the NICs to attach, in either mode, and no claim means nothing attached.
DEL, CHECK and GC never ask kubelet: it has often forgotten the pod by then; they use the state.
"""

from __future__ import annotations

from rdma_netns import events
from rdma_netns.config.loader import Config
from rdma_netns.config.netconf import NetConfig
from rdma_netns.grants.client import Grant, query
from rdma_netns.grants.early import Early
from rdma_netns.spec import versions
from rdma_netns.spec.env import CniEnv
from rdma_netns.spec.errors import INVALID_ENV, NOT_GRANTED, PAIRING_UNAVAILABLE, CniError


def add(env: CniEnv, cfg: Config, early: Early | None = None) -> dict:
    """ADD behind the pairing gate. A pod that pairing leaves out never loads the attaching code:
    start-up is most of its cost, and most pods on a node ask for no RDMA. `early`: the grants
    question entry.py sent before the config was validated (grants/early.py)."""
    grant = granted(env, cfg.net, early)
    if grant is not None:
        events.note("granted", bool(grant.device_ids))
    if attaches_nothing(grant, cfg.prev_result is not None, cfg.net.resource_name or ""):
        return attach_nothing(env, cfg)
    from rdma_netns.commands import add as add_command

    return versions.format_result(add_command.cmd_add(env, cfg, grant), cfg.cni_version)


def granted(env: CniEnv, net: NetConfig, early: Early | None = None) -> Grant | None:
    """The pod's grant of net.resource_name; None when pairing is off."""
    resource = net.resource_name
    if not resource:
        return None
    namespace, name = env.args.get("K8S_POD_NAMESPACE", ""), env.args.get("K8S_POD_NAME", "")
    if not namespace or not name:
        raise CniError(INVALID_ENV, f"\"resourceName\": \"{resource}\" pairs attachments with kubelet's device "
                       "grants, but CNI_ARGS names no K8S_POD_NAMESPACE and K8S_POD_NAME",
                       "a Kubernetes runtime (containerd, CRI-O) sends them; drop resourceName for other runtimes")
    grant = query(net, namespace, name, env.args.get("K8S_POD_UID", ""), early)
    if not grant.found:
        raise CniError(PAIRING_UNAVAILABLE, f"kubelet does not know pod {namespace}/{name} "
                       f"(PodResources {grant.via or 'query'})",
                       "kubelet admits a pod before its sandbox starts; a runtime outside kubelet's control?")
    return grant


def attaches_nothing(grant: Grant | None, chained: bool, resource: str) -> bool:
    """True when the pod gets nothing from this network (and that is fine); raises when not fine."""
    if grant is None or (grant.rails if grant.rails is not None else grant.device_ids):
        return False
    if chained:
        return True
    raise CniError(NOT_GRANTED, f"the pod was granted no {resource}, and this network is its only one",
                   f"ask for {resource} in the pod's resources, or chain rdma-netns after the cluster's CNI")


def attach_nothing(env: CniEnv, cfg: Config) -> dict:
    """A chained pod without a grant: the previous result back unchanged, and a marker so that the
    runtime's DELs of this attachment return at once (state.py)."""
    from rdma_netns.state import StateStore

    store = StateStore(cfg.net.state_dir, cfg.net.name)
    store.prepare()
    store.mark_released(env.container_id, env.ifname)
    return cfg.prev_result or {}
