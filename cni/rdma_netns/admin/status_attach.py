"""`status` checks of the attachments: how many, and what is left over.

Two kinds of leftover, each a warning with the step that clears it (no admin command does it):
- a state whose network namespace is gone: its pod is gone, its IPAM lease and published files are
  not. The plugin's own DEL releases them from the state alone (CNI_NETNS empty; a config with
  just the network name is enough: load_for_teardown), exactly what the runtime's DEL would do.
- a host-local lease (<dataDir>/<network>/<ip>: container ID, then the ifname) of one of our rails
  whose attachment has no state. ADD writes the state before IPAM ADD and DEL removes it after
  IPAM DEL, so such a lease is held by nobody; host-local's release is removing the file under its
  lock (<dataDir>/<network>/lock). In a network folder the primary CNI shares (chained: one
  network name for both), only leases whose ifname is a rail's count, never the primary's eth0.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
from collections import Counter

from rdma_netns.admin.status_context import DEFAULT_CNI_STATE_DIR, DEFAULT_IPAM_DIR, OK, WARN, Attachment, Check, Context

G = "Attachments"
RAIL_IFNAME = re.compile(r"rdma\d+")  # a rail's default pod-side name


def del_command(ctx: Context, a: Attachment) -> str:
    """The plugin's DEL for one attachment, as a shell line an admin can paste."""
    conf: dict = {"cniVersion": "1.0.0", "name": a.network, "type": "rdma-netns", "pairing": False}
    if ctx.state_dir != DEFAULT_CNI_STATE_DIR:
        conf["stateDir"] = ctx.state_dir
    bin_dir = ctx.opts.cni_bin_dir
    return (f"echo {shlex.quote(json.dumps(conf, separators=(',', ':')))} | CNI_COMMAND=DEL "
            f"CNI_CONTAINERID={shlex.quote(a.container_id)} CNI_IFNAME={shlex.quote(a.ifname)} CNI_NETNS= "
            f"CNI_PATH={shlex.quote(bin_dir)} {shlex.quote(os.path.join(bin_dir, 'rdma-netns'))}")


def lease_command(folder: str, ip_file: str) -> str:
    """host-local's own release of one address: its file removed under its folder's lock."""
    return f"flock {shlex.quote(os.path.join(folder, 'lock'))} rm -f {shlex.quote(os.path.join(folder, ip_file))}"


def attachments(ctx: Context) -> list[Check]:
    out = [_summary(ctx)]
    for a in ctx.attachments:
        problem = _state_problem(ctx, a)
        if problem is not None:
            out.append(problem)
    out += _leases(ctx)
    return out


def _summary(ctx: Context) -> Check:
    if not ctx.attachments:
        return Check(G, "attachments", OK, f"none in {ctx.state_dir}", data={"count": 0})
    phases = Counter(a.state.phase if a.state else "unreadable" for a in ctx.attachments)
    networks = sorted({a.network for a in ctx.attachments})
    text = ", ".join(f"{n} {p}" for p, n in sorted(phases.items()))
    return Check(G, "attachments", OK, f"{len(ctx.attachments)} in {ctx.state_dir} ({text}); network(s) "
                 f"{', '.join(networks)}", data={"count": len(ctx.attachments), "phases": dict(phases),
                                                  "networks": networks})


def _state_problem(ctx: Context, a: Attachment) -> Check | None:
    name = f"state {a.container_id[:12]}:{a.ifname}"
    data = {"kind": "state", "path": a.path, "network": a.network, "containerID": a.container_id, "ifname": a.ifname}
    st = a.state
    if st is None:
        return Check(G, name, WARN, f"{a.path} is not a state record (not a JSON object)",
                     f"if `crictl inspectp {a.container_id}` finds no such pod sandbox: `rm {shlex.quote(a.path)}`",
                     data)
    data.update(netns=st.netns, phase=st.phase, rails=len(st.rails))
    if st.netns and os.path.exists(st.netns):
        if st.unreadable():
            return Check(G, name, WARN, f"{st.unreadable()}: CHECK refuses it, DEL undoes what it can",
                         "finish the rollout: the version that wrote it reads it", data)
        return None
    gone = f"its netns {st.netns} is gone" if st.netns else "it records no netns"
    data["command"] = command = del_command(ctx, a)
    return Check(G, name, WARN, f"leftover in network {a.network}: {gone} (phase {st.phase or '?'}, "
                 f"{len(st.rails)} rail(s) still hold their addresses)",
                 f"release it with the plugin's DEL, which works from the state alone (what the runtime's DEL "
                 f"would have done): {command}", data)


def _ipam_dirs(ctx: Context) -> list[str]:
    """host-local's dataDirs: --ipam-dir, else those the config and the states name, else the default."""
    if ctx.opts.ipam_dir:
        return [ctx.opts.ipam_dir]
    ipams = [ctx.setting("ipam")] + [r.get("ipam") for r in ctx.rail_entries()]
    ipams += [r.get("ipam") for a in ctx.attachments if a.state for r in a.state.rails]
    dirs = [i["dataDir"] if isinstance(i.get("dataDir"), str) and i["dataDir"] else DEFAULT_IPAM_DIR for i in ipams
            if isinstance(i, dict) and i.get("type") == "host-local"]  # a dataDir of another type: refused at ADD
    return list(dict.fromkeys(dirs)) or [DEFAULT_IPAM_DIR]


def _rail_ifnames(ctx: Context) -> set[str]:
    names = {e.get("ifname") or f"rdma{i}" for i, e in enumerate(ctx.rail_entries())}
    names |= {r.get("ifname") for a in ctx.attachments if a.state for r in a.state.rails}
    return {n for n in names if isinstance(n, str)}


def _leases(ctx: Context) -> list[Check]:
    held: dict[str, set[tuple[str, str]]] = {}
    for a in ctx.attachments:
        for rail in a.state.rails if a.state else []:
            for network in {a.network, a.state.network}:
                held.setdefault(network, set()).add((a.container_id, rail.get("ifname")))
    networks = sorted({a.network for a in ctx.attachments} | ({ctx.network} if ctx.network else set()))
    ours_only = {doc.get("name") for _n, doc in ctx.standalone} - {(ctx.primary_doc or {}).get("name")}
    rail_names = _rail_ifnames(ctx)
    out = []
    for data_dir in _ipam_dirs(ctx):
        for network in networks:
            folder = os.path.join(data_dir, network)
            for ip_file, cid, ifname in _read_leases(folder):
                ours = network in ours_only or ifname in rail_names or bool(RAIL_IFNAME.fullmatch(ifname))
                if not ours or (cid, ifname) in held.get(network, set()):
                    continue
                out.append(Check(G, f"lease {ip_file}", WARN,
                                 f"leftover: {os.path.join(folder, ip_file)} holds the address for container "
                                 f"{cid[:12]} rail {ifname}, which has no rdma-netns state",
                                 "nobody holds it: free it as host-local does, under its lock: "
                                 + lease_command(folder, ip_file),
                                 {"kind": "lease", "path": os.path.join(folder, ip_file), "network": network,
                                  "containerID": cid, "ifname": ifname, "command": lease_command(folder, ip_file)}))
    return out


def _read_leases(folder: str) -> list[tuple[str, str, str]]:
    """(file name, container ID, ifname) of each lease in a host-local network folder."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            continue  # lock, last_reserved_ip.N
        try:
            with open(os.path.join(folder, name), errors="replace") as f:
                lines = f.read(4096).splitlines()
        except OSError:
            continue
        if len(lines) >= 2 and lines[0].strip():
            out.append((name, lines[0].strip(), lines[1].strip()))
    return out
