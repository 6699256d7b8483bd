"""`status` checks of the hardware side: the kernel's RDMA mode, the devices, the rails.

Read through sysfs only (DeviceSysfs under --sysfs-root), so the checks run the same on a node and
on a test's fake tree. The Devices group is an inventory (every port's state and GID fill); the
Rails group judges: a rail whose netdev is missing or down, has no RDMA port behind it, or whose
port is not ACTIVE or whose GID table is full fails, since an ADD on it would fail; GID entries of
pods' interfaces that no attachment record explains (rails/gid_audit.py: a tenant's own addresses) warn.
"""

from __future__ import annotations

import os
from _socket import AF_INET6

from rdma_netns import mode_policy
from rdma_netns.admin import mode as mode_cmd
from rdma_netns.admin.status_context import FAIL, OK, WARN, Check, Context
from rdma_netns.config.netconf import rail_range_rule
from rdma_netns.kernel import rtnl
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.kernel.rdma_devices import RdmaDevice
from rdma_netns.kernel.rdma_sysfs import GidUsage, RdmaPort
from rdma_netns.rails import gid_audit, node_range
from rdma_netns.spec.errors import CniError

NEARLY_FULL = 0.1  # warn when fewer pods than this share of the table's capacity still fit


def kernel(ctx: Context) -> list[Check]:
    """ib_core present; its netns mode, against the config's and the one set for the next boot."""
    g, sysfs = "Kernel", ctx.sysfs
    if not sysfs.subsystem_present():
        return [Check(g, "RDMA subsystem", FAIL, f"no RDMA core under {sysfs.root}: ib_core is not loaded",
                      "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re; Soft-RoCE: `modprobe rdma_rxe` and "
                      "`rdma link add rxe0 type rxe netdev <netdev>`)")]
    out = [Check(g, "RDMA subsystem", OK, "ib_core loaded")]
    live = sysfs.netns_mode()
    configured = ctx.setting("mode", "auto")
    persisted = mode_cmd.persisted_mode(ctx.opts.modprobe_file)
    data = {"mode": live, "configured": configured, "atBoot": persisted}
    said = f" (the config says {configured})" if ctx.config is not None else ""
    if live is None:
        out.append(Check(g, "netns mode", WARN, "unknown: ib_core has no netns_mode parameter here",
                         "`rdma system show` tells the mode on kernels without the parameter", data))
    elif configured in mode_policy.MODES and mode_policy.mismatch(configured, live):
        out.append(Check(g, "netns mode", FAIL, f"{mode_policy.mismatch(configured, live)}{said}: every ADD is "
                         "refused", mode_policy.fix_hint(configured), data))
    elif persisted is not None and persisted != live:
        out.append(Check(g, "netns mode", WARN, f"{live} now, but {ctx.opts.modprobe_file} makes it {persisted} "
                         "from the next boot", f"if {live} is right: `rdma-netns mode set {live} --persist`; if "
                         f"{persisted} is, reboot the node when its pods can go", data))
    else:
        out.append(Check(g, "netns mode", OK, f"{live}{said}", data=data))
    return out


def _pods_devices(ctx: Context) -> dict[str, str]:
    """RDMA devices and netdevs moved into live pods (exclusive mode): name -> container ID."""
    out: dict[str, str] = {}
    for a in ctx.attachments:
        st = a.state
        if st is None or st.mode == "shared" or not st.netns or not os.path.exists(st.netns):
            continue
        for rail in st.rails:
            for key in ("rdmaDevice", "netdev"):
                if isinstance(rail.get(key), str):
                    out[rail[key]] = a.container_id
    return out


def _gid_usage(ctx: Context, device: RdmaDevice, port: int) -> GidUsage | None:
    """The port's GID fill where it counts addresses (RoCE); None for InfiniBand and iWARP."""
    link = next((p.link_layer for p in device.ports if p.number == port), "Ethernet")
    if link != "Ethernet" or device.iwarp:
        return None
    return ctx.sysfs.gid_usage(RdmaPort(device.name, port))


def devices(ctx: Context) -> list[Check]:
    """Every device and port visible here: state, netdev, GID fill (an inventory; Rails judges)."""
    g = "Devices"
    if not ctx.sysfs.subsystem_present():
        return []
    found = ctx.devices()
    away = _pods_devices(ctx)
    if not found:
        if away:
            return [Check(g, "devices", OK, f"none visible here; {len(away)} in pods' namespaces (exclusive mode)")]
        return [Check(g, "devices", FAIL, "no RDMA device visible here",
                      "check the NIC's driver (`rdma link show`, `dmesg | grep -i mlx5`); Soft-RoCE: "
                      "`rdma link add rxe0 type rxe netdev <netdev>`")]
    rails = _rail_devices(ctx)
    out = []
    for device in found:
        netdev = device.bond or (device.netdevs[0] if device.netdevs else "-")
        for port in device.ports:
            usage = _gid_usage(ctx, device, port.number)
            gids = f", GIDs {usage.used}/{usage.total}" if usage else ""
            role = f" (rail {rails[device.name]})" if device.name in rails else ""
            out.append(Check(g, f"{device.name}/{port.number}", OK,
                             f"{port.state or '?'} {port.link_layer} on {netdev}{gids}{role}",
                             data={"device": device.name, "port": port.number, "state": port.state,
                                   "linkLayer": port.link_layer, "netdev": netdev,
                                   "gidsUsed": usage.used if usage else None,
                                   "gidsTotal": usage.total if usage else None}))
    return out


def _rail_devices(ctx: Context) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, entry in enumerate(_rail_entries(ctx)[0]):
        _netdev, port = _resolve(ctx, entry)
        if port is not None:
            out.setdefault(port.device, i)
    return out


def _rail_entries(ctx: Context) -> tuple[list[dict], str]:
    """The rails (config entries, or every RDMA device's netdev when none are listed) and whence."""
    entries = ctx.rail_entries()
    if entries:
        return entries, ctx.config_source
    netdevs = [nds[0] for dev in ctx.sysfs.device_names() if (nds := ctx.sysfs.rail_netdevs_of_device(dev))]
    where = ctx.config_source + ("; it lists no rails" if ctx.config is not None else "")
    return [{"netdev": nd} for nd in dict.fromkeys(netdevs)], f"every RDMA device's netdev ({where})"


def _resolve(ctx: Context, entry: dict) -> tuple[str | None, RdmaPort | None]:
    """A rail entry's host netdev (its bond under RoCE LAG) and RDMA port, as nics.netdev_of does."""
    sysfs = ctx.sysfs
    if entry.get("netdev"):
        netdev = sysfs.rail_netdev(entry["netdev"])
    else:
        if entry.get("rdmaDevice"):
            found = sysfs.netdevs_of_device(entry["rdmaDevice"])
        else:
            found = sysfs.netdevs_of_pci(str(entry.get("pciAddress") or ""))
        netdev = sysfs.rail_netdev(found[0]) if found else None
    if entry.get("rdmaDevice") and sysfs.has_device(entry["rdmaDevice"]):
        return netdev, RdmaPort(entry["rdmaDevice"], (sysfs.ports(entry["rdmaDevice"]) or [1])[0])
    return netdev, (sysfs.device_of_netdev(netdev) if netdev else None)


def link_state(root: str, netdev: str) -> tuple[bool, str]:
    """(usable, words): administratively up (IFF_UP in `flags`) and not without carrier."""
    base = f"{root}/class/net/{netdev}"
    try:
        with open(f"{base}/flags") as f:
            if not int(f.read().strip(), 16) & 1:
                return False, "administratively down"
    except (OSError, ValueError):
        pass
    try:
        with open(f"{base}/operstate") as f:
            oper = f.read().strip()
    except OSError:
        oper = "unknown"
    if oper in ("down", "lowerlayerdown", "notpresent", "dormant"):
        return False, f"operstate {oper}"
    return True, oper


def rails(ctx: Context) -> list[Check]:
    """Each rail: netdev present and up, an RDMA port behind it, ACTIVE, room in its GID table."""
    g = "Rails"
    if not ctx.sysfs.subsystem_present():
        return []
    entries, source = _rail_entries(ctx)
    if not entries:
        state = FAIL if ctx.config is not None else OK
        return [Check(g, "rails", state, f"no rail: {source} and no RDMA netdev here",
                      "list the NICs under \"rails\" (netdev, rdmaDevice or pciAddress)" if state == FAIL else "")]
    out = [Check(g, "source", OK, f"{len(entries)} rail(s) from {source}")]
    if ctx.setting("linkLocal", True) is False:
        out.append(_no_link_local())
    top_rule = ctx.setting("rangeFromNodeAddress")
    for i, entry in enumerate(entries):
        check = _rail(ctx, i, entry)
        out.append(check)
        rule = rail_range_rule(top_rule, entry.get("rangeFromNodeAddress"), entry.get("ipam"))
        if rule is not None and check.data and check.data.get("netdev"):
            out += _node_range(ctx, i, entry, check.data["netdev"], rule)
    return out


def _node_range(ctx: Context, index: int, entry: dict, netdev: str, rule: dict) -> list[Check]:
    """This node's pod range on the rail (rangeFromNodeAddress), as ADD derives it: a rail whose
    address is outside the configured prefix makes every RDMA pod's ADD fail (109)."""
    name = f"rail {index} {entry.get('ifname') or f'rdma{index}'} range"
    try:
        with NetlinkSocket() as sock:
            link = rtnl.get_link(sock, netdev)
            if link is None:  # not in this network namespace (the netdev check above speaks for it)
                return []
            addresses = rtnl.list_addresses(sock, AF_INET6, link.index)
    except OSError as exc:
        return [Check("Rails", name, WARN, f"cannot read {netdev}'s addresses: {exc}", "run status as root "
                      "in the node's network namespace")]
    try:
        found = node_range.derive(netdev, addresses, rule)
    except CniError as exc:
        where = ctx.config_source
        return [Check("Rails", name, FAIL, f"{exc.msg}: every RDMA pod's ADD fails with {exc.code}",
                      f"{exc.details}; or, if the fabric uses another prefix, set rangeFromNodeAddress.within in "
                      f"{where} (the Helm chart's fabric.prefix) to it", {"netdev": netdev, "within": rule.get("within")})]
    return [Check("Rails", name, OK, found.describe(), data={"netdev": netdev, "block": str(found.block)})]


def _no_link_local() -> Check:
    """A config that turns rail link-local addresses off trades RoCE's neighbour resolution for GID room."""
    return Check("Rails", "link-local", WARN,
                 "\"linkLocal\": false: pod rails have no IPv6 link-local address, so the kernel sends no "
                 "neighbour solicitation when a RoCE QP resolves its peer: RC connections over the pods' IPv6 "
                 "GIDs fail at RTR (\"Failed to modify QP to RTR\") unless other IPv6 traffic on the rail "
                 "resolved that peer first",
                 "remove \"linkLocal\": false from the entry (each pod then takes two addresses' GID entries per "
                 "rail: the device plugin's addressesPerPod 2, its default); keep it off only where every job "
                 "resolves its peers over the rail before connecting (docs/configuration.md: linkLocal)")


def _rail(ctx: Context, index: int, entry: dict) -> Check:
    g = "Rails"
    name = f"rail {index} {entry.get('ifname') or f'rdma{index}'}"
    selector = next((f"{k} {entry[k]}" for k in ("netdev", "rdmaDevice", "pciAddress") if entry.get(k)), "?")
    mode = mode_policy.resolve(ctx.setting("mode", "auto"), ctx.sysfs.netns_mode())
    netdev, port = _resolve(ctx, entry)
    data: dict = {"selector": selector, "netdev": netdev, "device": port.device if port else None,
                  "port": port.port if port else None}
    away = _pods_devices(ctx) if mode == "exclusive" else {}
    in_pod = next((away[k] for k in (netdev, entry.get("rdmaDevice"), entry.get("netdev")) if k in away), None)
    if in_pod is not None:
        return Check(g, name, OK, f"{selector}: in the pod of container {in_pod[:12]} (exclusive mode)", data=data)
    if netdev is None or not os.path.exists(f"{ctx.sysfs.root}/class/net/{netdev}"):
        return Check(g, name, FAIL, f"{selector}: no such netdev here" + (f" ({netdev})" if netdev else ""),
                     f"correct the rail in {ctx.config_source} (`rdma-netns devices` lists this node's RDMA "
                     "netdevs), or bring the NIC back (`ip link show`)", data)
    up, words = link_state(ctx.sysfs.root, netdev)
    data["link"] = words
    if not up:
        return Check(g, name, FAIL, f"{netdev} is {words}: pods' interfaces on it have no link",
                     f"`ip link set {netdev} up` (and in the node's network config, so it stays up), check its "
                     "cable and switch port", data)
    if port is None:
        required = ctx.setting("requireRdma", True) is not False
        return Check(g, name, FAIL if required else WARN, f"{netdev} has no RDMA device behind it",
                     "a rail must be an RDMA netdev: name one that `rdma-netns devices` lists, or load the NIC's "
                     "RDMA driver", data)
    state, _phys, link_layer = ctx.sysfs.port_status(port.device, port.port)
    data["state"] = state
    where = f"{netdev} -> {port.device}/{port.port}"
    if state != "ACTIVE":
        return Check(g, name, FAIL, f"{where} is {state or 'in an unknown state'}: no RDMA traffic on it",
                     f"bring the port up: its cable and switch port; `rdma link show {port.device}/{port.port}`", data)
    device = next((d for d in ctx.devices() if d.name == port.device), None)
    usage = _gid_usage(ctx, device, port.port) if device is not None and mode == "shared" else None
    if usage is None:
        return Check(g, name, OK, f"{where} ACTIVE {link_layer}", data=data)
    check = _gid_check(ctx, name, where, usage, netdev, data)
    return _unexplained_gids(ctx, port, check)


def _unexplained_gids(ctx: Context, port: RdmaPort, check: Check) -> Check:
    """Entries of pods' interfaces on the rail's port that no attachment record explains: addresses
    a pod added itself (CAP_NET_ADMIN), which fill the table every pod on the NIC shares."""
    states = [a.state for a in ctx.attachments if a.state is not None]
    found = gid_audit.audit(ctx.sysfs, [port], states).get(port)
    check.data["gidsUnexplained"] = found.unexplained if found else 0
    if found is None or not found.unexplained:
        return check
    shown = ", ".join(f"{gid_audit.address_of(gid)} (on {ndev})" for gid, ndev in found.samples)
    check.data["gidsUnexplainedSamples"] = [{"gid": gid, "ndev": ndev} for gid, ndev in found.samples]
    check.detail += (f"; {found.unexplained} GID entries of pods' interfaces that no attachment record explains "
                     f"(addresses a pod added itself), e.g. {shown}")
    fix = ("find the pod holding them (`ip -all netns exec ip -br addr | grep <address>` on the node), remove the "
           "addresses, and forbid NET_ADMIN in pods with rails (docs/security.md: \"Tenants and the GID table\")")
    check.fix = f"{check.fix}; {fix}" if check.fix else fix
    if check.state == OK:
        check.state = WARN
    return check


def _gid_check(ctx: Context, name: str, where: str, usage: GidUsage, netdev: str, data: dict) -> Check:
    """Shared mode: every pod address on the rail takes usage.per_address entries of its table."""
    link_local = ctx.setting("linkLocal", True) is not False
    per_pod = 2 if link_local else 1
    left = usage.free_addresses // per_pod
    capacity = usage.total // usage.per_address // per_pod
    data.update(gidsUsed=usage.used, gidsTotal=usage.total, perAddress=usage.per_address, inPods=usage.in_pods,
                podsLeft=left)
    fill = (f"GIDs {usage.used}/{usage.total} ({usage.per_address} per address, {usage.in_pods} in pods)")
    entries = "two entries per address (RoCE v1 and v2, as mlx5 makes them)" if usage.per_address == 2 \
        else "one entry per address"
    fix = (f"the table takes {entries}: run fewer RDMA pods on this node, remove addresses nobody uses from "
           f"{netdev} and interfaces stacked on it" + ("; turn linkLocal off (halves each pod's use)" if link_local
                                                        else "") + " (docs/roce-lag.md: GID table capacity)")
    if left == 0:
        return Check("Rails", name, FAIL, f"{where} ACTIVE, GID table full: {fill}; a new pod's address "
                     "gets no GID and its ADD fails", fix, data)
    if left < max(1, capacity * NEARLY_FULL):
        return Check("Rails", name, WARN, f"{where} ACTIVE, GID table nearly full: {fill}, room for {left} more "
                     "pod(s)", fix, data)
    return Check("Rails", name, OK, f"{where} ACTIVE, {fill}, room for {left} more pod(s)", data=data)
