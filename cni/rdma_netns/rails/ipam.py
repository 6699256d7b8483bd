"""Delegated IPAM: run a standard IPAM plugin (host-local, static, dhcp, ...) from CNI_PATH.

Each rail gets its own IPAM allocation. Rails whose configs are host-local alike but for their
ranges get it from ONE host-local call (plan_calls): host-local gives one address per range set,
in order, so the rails' range sets side by side make one call answer for all of them, under the
first rail's interface name (the "holder", which the state records for DEL, CHECK and GC). On an
8-rail pod that is one Go process instead of eight contending for two cores and one lock. Other
IPAM plugins, and rails with other settings, get a call each, with CNI_IFNAME set to the rail's
interface name, so one container's rails hold separate allocations.
"""

from __future__ import annotations

import posix

from _socket import AF_INET, AF_INET6, inet_pton

from rdma_netns.rails import execplugin
from rdma_netns.spec import versions
from rdma_netns.spec.env import process_environ
from rdma_netns.spec.errors import IPAM_FAILED, CniError
from rdma_netns.util import jsonio, paths

# ADD/DEL/CHECK results are the same in 1.0.0 and 1.1.0, so delegates are asked in at most
# 1.0.0: IPAM plugins built before spec 1.1 (Debian 12's) still answer.
MAX_DELEGATE_VERSION = "1.0.0"


def find_plugin(plugin_type: str, cni_path: list[str]) -> str:
    for folder in cni_path:
        candidate = paths.join(folder, plugin_type)
        if paths.isfile(candidate) and posix.access(candidate, posix.X_OK):
            return candidate
    raise CniError(IPAM_FAILED, f"IPAM plugin {plugin_type!r} not found in CNI_PATH",
                   f"searched: {':'.join(cni_path) or '(CNI_PATH is empty)'}")


def delegate_version(cni_version: str) -> str:
    return cni_version if versions.parse(cni_version) <= versions.parse(MAX_DELEGATE_VERSION) else MAX_DELEGATE_VERSION


def speaks_1_1(ipam: dict, cni_path: list[str], timeout: float) -> bool:
    """Does this IPAM plugin implement spec 1.1 (STATUS, GC)? Asked with VERSION."""
    plugin = find_plugin(ipam["type"], cni_path)
    try:
        env = dict(process_environ(), CNI_COMMAND="VERSION")
        proc = execplugin.run(plugin, b'{"cniVersion":"1.1.0"}', env, timeout)
        return "1.1.0" in jsonio.loads(proc.stdout).get("supportedVersions", [])
    except (execplugin.TimedOut, OSError, ValueError, AttributeError):
        return False


class Request:
    """One rail's IPAM allocation: its IPAM config and the rail's interface name; `holder`, the
    interface name its allocation is held under when a shared call made it (the state's record)."""

    __slots__ = ("ipam", "ifname", "holder")

    def __init__(self, ipam: dict, ifname: str, holder: str | None = None) -> None:
        self.ipam, self.ifname, self.holder = ipam, ifname, holder


class Call:
    """One IPAM plugin process: the config it gets, the CNI_IFNAME it runs under, and the
    requests (by index) it answers for, with how many range sets each brought."""

    __slots__ = ("ipam", "ifname", "members", "sizes", "names")

    def __init__(self, ipam: dict, ifname: str, members: list[int], sizes: list[int], names: list[str]) -> None:
        self.ipam, self.ifname, self.members, self.sizes, self.names = ipam, ifname, members, sizes, names

    @property
    def shared(self) -> bool:
        return len(self.members) > 1


SHARED_TYPE = "host-local"
_LEGACY_RANGE_KEYS = ("subnet", "rangeStart", "rangeEnd", "gateway", "range")  # host-local prepends these


def plan_calls(requests: list[Request], *, share: bool) -> list[Call]:
    """The calls that serve `requests`. share=True (ADD): host-local rails alike but for
    non-overlapping ranges share one call, held under the first one's interface name. share=False
    (DEL, CHECK, rollback): as the state recorded it, rails with one holder share its call, the
    others (states of older versions included) get a call each."""
    groups: dict[object, list[int]] = {}
    for n, req in enumerate(requests):
        if share:
            key = _sharing_key(req.ipam)
            groups.setdefault(key if key is not None else ("own", n), []).append(n)
        else:
            groups.setdefault(("held", req.holder) if req.holder else ("own", n), []).append(n)
    calls: list[Call] = []
    for members in groups.values():
        if len(members) > 1 and share and not _disjoint([requests[n].ipam["ranges"] for n in members]):
            calls.extend(_single(requests, n) for n in members)  # host-local would refuse the overlap
        elif len(members) > 1:
            calls.append(_shared(requests, members))
        else:
            calls.append(_single(requests, members[0]))
    calls.sort(key=lambda call: call.members[0])
    return calls


def hold_shared(rail_states: list[dict]) -> None:
    """ADD, before its first record: which rails share a call, as `ipamHolder` in their state (the
    interface name the allocation is held under), so that every later call (ADD's own, DEL, CHECK,
    a rollback, GC's valid list) is made the same way, by this version or a later one."""
    requests = [Request(rail["ipam"], rail["ifname"]) for rail in rail_states]
    for call in plan_calls(requests, share=True):
        if call.shared:
            for n in call.members:
                rail_states[n]["ipamHolder"] = call.ifname


def recorded(rail_states: list[dict]) -> list[Request]:
    """The rails' IPAM requests as their state records them (holders included)."""
    return [Request(rail["ipam"], rail["ifname"], rail.get("ipamHolder")) for rail in rail_states]


def _single(requests: list[Request], n: int) -> Call:
    req = requests[n]
    return Call(req.ipam, req.holder or req.ifname, [n], [len(_range_sets(req.ipam))], [req.ifname])


def _shared(requests: list[Request], members: list[int]) -> Call:
    first = requests[members[0]]
    ranges: list = []
    sizes: list[int] = []
    for n in members:
        own = _range_sets(requests[n].ipam)
        ranges.extend(own)
        sizes.append(len(own))
    conf = dict(first.ipam, ranges=ranges)
    return Call(conf, first.holder or first.ifname, members, sizes, [requests[n].ifname for n in members])


def _range_sets(conf: dict) -> list:
    """The config's range sets; none when `ranges` is absent or not a list (the config model
    refuses that at ADD; a record of an older version must still be torn down)."""
    ranges = conf.get("ranges")
    return ranges if isinstance(ranges, list) else []


def _sharing_key(conf: dict) -> str | None:
    """What must be equal for rails to share a host-local call (all but the ranges); None when
    this config cannot share (another plugin, no ranges list, a legacy top-level range)."""
    if conf.get("type") != SHARED_TYPE or any(key in conf for key in _LEGACY_RANGE_KEYS):
        return None
    ranges = conf.get("ranges")
    if not isinstance(ranges, list) or not ranges or not all(isinstance(rs, list) and rs for rs in ranges):
        return None
    return jsonio.dumps({k: v for k, v in sorted(conf.items()) if k != "ranges"})


def _disjoint(range_lists: list[list]) -> bool:
    """Do the rails' subnets overlap nowhere (host-local refuses overlapping range sets)? False
    also when a subnet does not parse: each rail's own call then reports it as it always did."""
    seen: list[tuple[int, int, int]] = []  # (family, first, last)
    for ranges in range_lists:
        for range_set in ranges:
            for entry in range_set:
                span = _span(entry.get("subnet") if isinstance(entry, dict) else None)
                if span is None:
                    return False
                if any(f == span[0] and a <= span[2] and span[1] <= b for f, a, b in seen):
                    return False
                seen.append(span)
    return True


def _span(subnet: object) -> tuple[int, int, int] | None:
    if not isinstance(subnet, str) or subnet.count("/") != 1:
        return None
    address, _, length = subnet.partition("/")
    family = AF_INET6 if ":" in address else AF_INET
    try:
        value = int.from_bytes(inet_pton(family, address), "big")
        bits = 128 if family == AF_INET6 else 32
        prefix = int(length)
    except (OSError, ValueError):
        return None
    if not 0 <= prefix <= bits:
        return None
    host = (1 << (bits - prefix)) - 1
    return family, value & ~host, value | host


def invoke(command: str, *, ipam: dict, network: str, cni_version: str, container_id: str, netns: str,
           ifname: str, cni_path: list[str], timeout: float, extra: dict | None = None) -> dict | None:
    """Run the IPAM plugin for one command; its parsed result for ADD, None otherwise.

    STATUS and GC exist only in spec 1.1 and are sent as 1.1.0 (callers check speaks_1_1).
    """
    (outcome,) = invoke_many(command, [Request(ipam, ifname)], network=network, cni_version=cni_version,
                             container_id=container_id, netns=netns, cni_path=cni_path, timeout=timeout,
                             extra=extra)
    if isinstance(outcome, CniError):
        raise outcome
    return outcome


def invoke_many(command: str, requests: list[Request], *, network: str, cni_version: str, container_id: str,
                netns: str, cni_path: list[str], timeout: float, extra: dict | None = None,
                spawned_hook=None) -> list[dict | None | CniError]:
    """Run the requests' calls (plan_calls as their holders say: rails of one holder share its
    call) at once (the plugins are separate processes; each keeps its own lock and store) with
    one time limit for all. One outcome per request, in order:
    its own part of the parsed result for ADD (None for other commands), or the CniError
    (IpamRefused when the plugin answered with a CNI error) its call ended with. Never raises for
    a plugin's failure."""
    version = "1.1.0" if command in ("STATUS", "GC") else delegate_version(cni_version)
    outcomes: list[dict | None | CniError] = [None] * len(requests)
    spawns: list[tuple[str, bytes, dict[str, str]]] = []
    started: list[Call] = []
    for call in plan_calls(requests, share=False):
        try:
            plugin = find_plugin(call.ipam["type"], cni_path)
        except CniError as exc:
            for n in call.members:
                outcomes[n] = exc
            continue
        conf: dict[str, object] = {"cniVersion": version, "name": network, "ipam": call.ipam}
        if extra:
            conf.update(extra)
        env = dict(process_environ())
        env.update(CNI_COMMAND=command, CNI_CONTAINERID=container_id, CNI_NETNS=netns, CNI_IFNAME=call.ifname,
                   CNI_PATH=":".join(cni_path))
        spawns.append((plugin, jsonio.dumps(conf).encode(), env))
        started.append(call)
    for call, proc in zip(started, execplugin.run_many(spawns, timeout, spawned_hook) if spawns else []):
        for n, outcome in zip(call.members, _split(command, call, proc, timeout)):
            outcomes[n] = outcome
    return outcomes


def _split(command: str, call: Call, proc: execplugin.Finished | BaseException,
           timeout: float) -> list[dict | None | CniError]:
    """One outcome per member of the call: a shared ADD's addresses dealt out by range set."""
    outcome = _outcome(command, call, proc, timeout)
    if not call.shared or not isinstance(outcome, dict):
        return [outcome] * len(call.members)
    ips = outcome["ips"]
    if len(ips) != sum(call.sizes):
        error = CniError(IPAM_FAILED, f"IPAM {call.ipam['type']} returned {len(ips)} addresses for the "
                         f"{sum(call.sizes)} range sets of {', '.join(call.names)}")
        return [error] * len(call.members)
    parts: list[dict | None | CniError] = []
    start = 0
    for size in call.sizes:
        part = {k: v for k, v in outcome.items() if k != "ips"}
        part["ips"] = [{k: v for k, v in ip.items() if k != "interface"} for ip in ips[start:start + size]]
        parts.append(part)
        start += size
    return parts


def _outcome(command: str, call: Call, proc: execplugin.Finished | BaseException,
             timeout: float) -> dict | None | CniError:
    kind, ifname = call.ipam["type"], _names(call, proc)
    if isinstance(proc, execplugin.TimedOut):
        return CniError(IPAM_FAILED, f"IPAM {kind} {command} for {ifname} timed out after {timeout:g} s")
    if isinstance(proc, BaseException):
        return CniError(IPAM_FAILED, f"IPAM {kind} could not be run: {proc}")
    if proc.returncode != 0:
        error = IpamRefused if _is_cni_error(proc) else CniError
        return error(IPAM_FAILED, f"IPAM {kind} {command} for {ifname} failed: {_error_text(proc)}")
    if command != "ADD":
        return None
    try:
        result = jsonio.loads(proc.stdout)
    except ValueError:
        return CniError(IPAM_FAILED, f"IPAM {kind} returned no JSON result")
    if not isinstance(result, dict) or not result.get("ips"):
        return CniError(IPAM_FAILED, f"IPAM {kind} returned no IP address for {ifname}")
    return result


class IpamRefused(CniError):
    """The IPAM plugin answered with a CNI error: it decided, and holds nothing for this call.
    (A timeout, a crash or garbage output leaves that unknown.)"""


def _names(call: Call, proc: execplugin.Finished | BaseException) -> str:
    """The rail(s) an outcome is about: a shared call's error names the rail whose range set
    host-local could not serve ("failed to allocate for range N"), else all of its rails."""
    if not call.shared:
        return call.names[0]
    if isinstance(proc, execplugin.Finished) and proc.returncode != 0:
        text = _error_text(proc)
        marker = text.find("for range ")
        digits = text[marker + 10:].split(":", 1)[0].strip() if marker >= 0 else ""
        if digits.isdigit():
            index, start = int(digits), 0
            for name, size in zip(call.names, call.sizes):
                if start <= index < start + size:
                    return f"{name} (in one call for {', '.join(call.names)})"
                start += size
    return f"{', '.join(call.names)} (one call)"


def _is_cni_error(proc: execplugin.Finished) -> bool:
    try:
        err = jsonio.loads(proc.stdout)
    except ValueError:
        return False
    return isinstance(err, dict) and isinstance(err.get("code"), int)


def _error_text(proc: execplugin.Finished) -> str:
    try:
        err = jsonio.loads(proc.stdout)
        msg = err.get("msg", "")
        if err.get("details"):
            msg += f" ({err['details']})"
        return msg or f"exit {proc.returncode}"
    except (ValueError, AttributeError):
        text = (proc.stdout or proc.stderr).decode(errors="replace").strip()
        return text[:500] or f"exit {proc.returncode}"


def distinct(ipams: list[dict]) -> list[dict]:
    """Each IPAM config once, in order (STATUS and GC ask each plugin configuration once)."""
    out: list[dict] = []
    for conf in ipams:
        if conf not in out:
            out.append(conf)
    return out
