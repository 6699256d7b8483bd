"""Per rail, whatever the mode: which NICs an attachment uses (nics.py, the rail plan), the
addresses and per-rail routing of a rail's interface in the pod (addressing.py), the delegated
IPAM (ipam.py, which runs the IPAM plugins through execplugin.py), this node's pod range on a
rail (node_range.py), the node-wide lock that keeps a pod's GID indexes equal across its rails
(gid_order.py) and the read-only audit of GID entries no attachment record explains
(gid_audit.py). Modules here may import kernel/, spec/, util/, config/netconf.py (the typed
config, never the pydantic model) and state.py; never commands/, modes/, grants/ or publish/:
the commands and the modes call them, not the other way round.
"""
