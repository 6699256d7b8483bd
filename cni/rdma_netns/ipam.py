"""Delegated IPAM: run a standard IPAM plugin (host-local, static, dhcp, ...) from CNI_PATH.

Each rail gets its own IPAM call, with CNI_IFNAME set to the rail's interface name, so one
container's rails hold separate allocations even when they share an IPAM config.
"""

from __future__ import annotations

import os

from rdma_netns import execplugin, jsonio
from rdma_netns.spec import versions
from rdma_netns.spec.errors import IPAM_FAILED, CniError

# ADD/DEL/CHECK results are the same in 1.0.0 and 1.1.0, so delegates are asked in at most
# 1.0.0: IPAM plugins built before spec 1.1 (Debian 12's) still answer.
MAX_DELEGATE_VERSION = "1.0.0"


def find_plugin(plugin_type: str, cni_path: list[str]) -> str:
    for folder in cni_path:
        candidate = os.path.join(folder, plugin_type)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise CniError(IPAM_FAILED, f"IPAM plugin {plugin_type!r} not found in CNI_PATH",
                   f"searched: {':'.join(cni_path) or '(CNI_PATH is empty)'}")


def delegate_version(cni_version: str) -> str:
    return cni_version if versions.parse(cni_version) <= versions.parse(MAX_DELEGATE_VERSION) else MAX_DELEGATE_VERSION


def speaks_1_1(ipam: dict, cni_path: list[str], timeout: float) -> bool:
    """Does this IPAM plugin implement spec 1.1 (STATUS, GC)? Asked with VERSION."""
    plugin = find_plugin(ipam["type"], cni_path)
    try:
        proc = execplugin.run(plugin, b'{"cniVersion":"1.1.0"}', dict(os.environ, CNI_COMMAND="VERSION"), timeout)
        return "1.1.0" in jsonio.loads(proc.stdout).get("supportedVersions", [])
    except (execplugin.TimedOut, OSError, ValueError, AttributeError):
        return False


class Request:
    """One IPAM call of a rail: its IPAM config and the rail's interface name."""

    __slots__ = ("ipam", "ifname")

    def __init__(self, ipam: dict, ifname: str) -> None:
        self.ipam, self.ifname = ipam, ifname


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
    """Run every rail's IPAM call at once (the plugins are separate processes; each keeps its own
    lock and store) with one time limit for all. One outcome per request, in order: the parsed
    result for ADD (None for other commands), or the CniError (IpamRefused when the plugin
    answered with a CNI error) that request ended with. Never raises for a plugin's failure."""
    version = "1.1.0" if command in ("STATUS", "GC") else delegate_version(cni_version)
    outcomes: list[dict | None | CniError] = [None] * len(requests)
    calls: list[tuple[str, bytes, dict[str, str]]] = []
    index: list[int] = []
    for n, req in enumerate(requests):
        try:
            plugin = find_plugin(req.ipam["type"], cni_path)
        except CniError as exc:
            outcomes[n] = exc
            continue
        conf: dict[str, object] = {"cniVersion": version, "name": network, "ipam": req.ipam}
        if extra:
            conf.update(extra)
        env = dict(os.environ)
        env.update(CNI_COMMAND=command, CNI_CONTAINERID=container_id, CNI_NETNS=netns, CNI_IFNAME=req.ifname,
                   CNI_PATH=":".join(cni_path))
        calls.append((plugin, jsonio.dumps(conf).encode(), env))
        index.append(n)
    for n, proc in zip(index, execplugin.run_many(calls, timeout, spawned_hook) if calls else []):
        outcomes[n] = _outcome(command, requests[n], proc, timeout)
    return outcomes


def _outcome(command: str, req: Request, proc: execplugin.Finished | BaseException,
             timeout: float) -> dict | None | CniError:
    kind, ifname = req.ipam["type"], req.ifname
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
