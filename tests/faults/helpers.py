"""Helpers for the fault tests: exact snapshots of a node (and a pod), fake IPAM plugins,
crash-aware plugin runs.

A snapshot is what "restored exactly" means in these tests: every link of the namespace with
its name, MAC, kind, MTU and admin state; every global address; every IPv4/IPv6 rule; every
route of every table; every host-local allocation (file name and content); every state file.
IPv6 link-local addresses (and their local-table routes) are left out: the kernel regenerates
them after a NIC comes back from a pod, after its own DAD, on a timer of its own.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

from tests.netns.conftest import ip

# Codes docs/troubleshooting.md lists (spec and the plugin's own). 999 (internal error) is deliberately absent.
SPEC_CODES = {1, 2, 3, 4, 5, 6, 7, 11, 50, 100, 101, 102, 103, 104, 105, 106}
VOLATILE_ROUTE_KEYS = ("expires", "flags", "pref", "protocol")


def _ipj(netns: str, *args: str) -> list:
    out = subprocess.run(["ip", "-n", netns, "-j", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out) if out.strip() else []


def netns_view(netns: str) -> dict:
    """Links, global addresses, rules and routes (all tables) of one namespace."""
    links = sorted(
        (lk["ifname"], lk.get("address"), "UP" in lk.get("flags", []), lk.get("linkinfo", {}).get("info_kind", ""),
         lk.get("mtu"))
        for lk in _ipj(netns, "-d", "link"))
    addrs = sorted(
        (a["ifname"], f"{i['local']}/{i['prefixlen']}")
        for a in _ipj(netns, "addr") for i in a.get("addr_info", [])
        if i.get("scope") != "link" and not i["local"].startswith("fe80"))
    rules = {fam: _ipj(netns, fam, "rule") for fam in ("-4", "-6")}
    routes = {}
    for fam in ("-4", "-6"):
        kept = []
        for r in _ipj(netns, fam, "route", "show", "table", "all"):
            if r.get("type") == "local" and str(r.get("dst", "")).startswith("fe80"):
                continue
            kept.append({k: v for k, v in r.items() if k not in VOLATILE_ROUTE_KEYS})
        routes[fam] = sorted(kept, key=lambda r: json.dumps(r, sort_keys=True))
    return {"links": links, "addrs": addrs, "rules": rules, "routes": routes}


def tree(folder: str, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every regular file (and symlink) under `folder`, relative name -> content (or link target)."""
    out: dict[str, str] = {}
    base = Path(folder)
    if not base.exists():
        return out
    for root, dirs, files in os.walk(base):
        rel_root = Path(root).relative_to(base)
        dirs[:] = [d for d in dirs if str(rel_root / d) not in skip]
        for name in files:
            path = Path(root) / name
            rel = str(rel_root / name)
            if rel in skip:
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "symlink->" + os.readlink(path)
            else:
                out[rel] = path.read_text(errors="replace")
    return out


def ipam_leases(node) -> dict[str, str]:
    """host-local's leases of every network (not its lock or last-reserved bookkeeping)."""
    return {k: v for k, v in tree(node.ipam_dir).items()
            if not k.endswith("/lock") and "last_reserved_ip" not in k}


def state_files(node) -> dict[str, str]:
    """The attachment state (not the lock stripes, the verified-config cache, or the markers of
    released attachments, which only make repeated DELs cheap and expire by themselves)."""
    return {name: content for name, content in tree(node.state_dir, skip=("locks", "verified-configs")).items()
            if name.split("/")[1:2] != ["released"]}


def snapshot(node, pods: list[str] = ()) -> dict:
    return {"node": netns_view(node.name), "pods": {p: netns_view(p) for p in pods},
            "ipam": ipam_leases(node), "state": state_files(node)}


def assert_same(node, before: dict, pods: list[str] = (), timeout: float = 3.0) -> None:
    """The node (and pods) are exactly as in `before` (waiting briefly for the kernel's own
    asynchronous work, e.g. the routes of a NIC that just came back)."""
    deadline = time.monotonic() + timeout
    while True:
        now = snapshot(node, pods)
        if now == before:
            return
        if time.monotonic() > deadline:
            raise AssertionError("node not restored:\n" + "\n".join(describe_diff(before, now))[:6000])
        time.sleep(0.1)


def _flatten(value, prefix: str = "") -> set[str]:
    """Leaves of a snapshot as 'path: json' strings (list items keyed by their content)."""
    if isinstance(value, dict):
        return set().union(*(_flatten(v, f"{prefix}/{k}") for k, v in value.items())) if value else {f"{prefix}: {{}}"}
    if isinstance(value, list):
        return {f"{prefix}: {json.dumps(v, sort_keys=True)}" for v in value}
    return {f"{prefix}: {json.dumps(value)}"}


def describe_diff(before: dict, now: dict) -> list[str]:
    a, b = _flatten(before), _flatten(now)
    return [f"- {x}" for x in sorted(a - b)] + [f"+ {x}" for x in sorted(b - a)]


def killed_by_sigkill(result) -> bool:
    """run_plugin's return code of a SIGKILLed plugin: -9 directly, 137 through a shell/ip wrapper."""
    return result.code in (-9, 137)


def write_script(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def rail_links(node, pod: str) -> set[str]:
    return set(node.links(pod)) - {"lo"}


def assert_json_answer(result, allow_ok: bool = True) -> None:
    """One JSON object on stdout: a result (exit 0) or an error with a spec code; no traceback.
    (DEL, CHECK, GC and STATUS succeed with an empty stdout.)"""
    assert "Traceback" not in result.stdout, result.stdout
    text = result.stdout.strip()
    if result.code == 0 and not text:
        assert allow_ok
        return
    assert text, f"nothing on stdout (exit {result.code}); stderr: {result.stderr[-2000:]}"
    assert "\n" not in text, f"more than one line on stdout: {text[:2000]}"
    value = json.loads(text)
    assert isinstance(value, dict), value
    if result.code == 0:
        assert allow_ok, value
        assert "code" not in value, value
    else:
        assert result.code == 1, (result.code, value)
        assert value.get("code") in SPEC_CODES, f"not a documented code: {value}; stderr: {result.stderr[-3000:]}"
        assert isinstance(value.get("msg"), str) and value["msg"], value


__all__ = ["SPEC_CODES", "assert_json_answer", "assert_same", "ip", "ipam_leases", "killed_by_sigkill",
           "netns_view", "rail_links", "snapshot", "state_files", "tree", "write_script"]
