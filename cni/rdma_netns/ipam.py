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


def invoke(command: str, *, ipam: dict, network: str, cni_version: str, container_id: str, netns: str,
           ifname: str, cni_path: list[str], timeout: float, extra: dict | None = None) -> dict | None:
    """Run the IPAM plugin for one command; its parsed result for ADD, None otherwise.

    STATUS and GC exist only in spec 1.1 and are sent as 1.1.0 (callers check speaks_1_1).
    """
    plugin = find_plugin(ipam["type"], cni_path)
    version = "1.1.0" if command in ("STATUS", "GC") else delegate_version(cni_version)
    conf: dict[str, object] = {"cniVersion": version, "name": network, "ipam": ipam}
    if extra:
        conf.update(extra)
    env = dict(os.environ)
    env.update(CNI_COMMAND=command, CNI_CONTAINERID=container_id, CNI_NETNS=netns, CNI_IFNAME=ifname,
               CNI_PATH=":".join(cni_path))
    try:
        proc = execplugin.run(plugin, jsonio.dumps(conf).encode(), env, timeout)
    except execplugin.TimedOut:
        raise CniError(IPAM_FAILED, f"IPAM {ipam['type']} {command} for {ifname} timed out after {timeout:g} s") from None
    except OSError as exc:
        raise CniError(IPAM_FAILED, f"IPAM {ipam['type']} could not be run: {exc}") from None
    if proc.returncode != 0:
        error = IpamRefused if _is_cni_error(proc) else CniError
        raise error(IPAM_FAILED, f"IPAM {ipam['type']} {command} for {ifname} failed: {_error_text(proc)}")
    if command != "ADD":
        return None
    try:
        result = jsonio.loads(proc.stdout)
    except ValueError:
        raise CniError(IPAM_FAILED, f"IPAM {ipam['type']} returned no JSON result") from None
    if not isinstance(result, dict) or not result.get("ips"):
        raise CniError(IPAM_FAILED, f"IPAM {ipam['type']} returned no IP address for {ifname}")
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
