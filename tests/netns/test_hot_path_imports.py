"""The start-up rule docs/benchmarks.md states, enforced: after a network config's first call (its one
pydantic validation, then cached), ADD, CHECK and DEL import nothing heavy.

Each call runs the installed package in a fresh interpreter inside the test's node namespace, on
real pod namespaces and Debian's host-local, and reports the modules it loaded. The first ADD of a
new config is the negative control: it must show pydantic, which proves the probe sees imports.
"""

from __future__ import annotations

import json
import subprocess
import sys

# What docs/benchmarks.md says the CNI hot path does not load, and why:
FORBIDDEN = {
    "pyroute2": "~0.3 s to import; the stdlib netlink codec serves the hot path",
    "pydantic": "~0.15 s; the verdict on a config is cached",
    "pydantic_core": "comes with pydantic",
    "ipaddress": "inet_pton does the parsing",
    "subprocess": "posix_spawn runs the IPAM plugin",
    "json": "the C _json scanner (jsonio) is the codec",
    "dataclasses": "imports inspect (~10 ms); hot-path types are __slots__ classes",
    "inspect": "heavy, and a sign of dataclasses or typing machinery",
    "typing": "annotations stay strings (from __future__ import annotations)",
    "grpc": "the pairing query goes through the device plugin's broker",
    "google": "protobuf comes with grpc",
    "logging": "stderr lines are written directly",
}
# the admin tool, the pydantic model, and the device plugin's dataclass records of the kernel
FORBIDDEN_OWN = ("rdma_netns.admin", "rdma_netns.config.model", "rdma_netns.kernel.rdma_devices")

PROBE = (
    "import sys\n"
    "before = set(sys.modules)\n"
    "from rdma_netns import entry\n"
    "env = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
    "rc = entry.run_cni(env, sys.stdin.buffer.read())\n"
    "sys.stderr.write('LOADED ' + ' '.join(sorted(set(sys.modules) - before)) + '\\n')\n"
    "sys.stderr.write('RC %d\\n' % rc)\n"
)


def run_probe(node, command: str, conf: dict, pod: str | None, container_id: str) -> tuple[set[str], str]:
    """(modules the call loaded, its stdout)"""
    env = {"CNI_COMMAND": command, "CNI_CONTAINERID": container_id, "CNI_IFNAME": conf["rails"][0]["ifname"],
           "CNI_NETNS": node.netns_path(pod) if pod else "", "CNI_PATH": "/usr/lib/cni"}
    argv = [item for pair in env.items() for item in pair]
    proc = subprocess.run(["ip", "netns", "exec", node.name, sys.executable, "-I", "-c", PROBE, *argv],
                          input=json.dumps(conf).encode(), capture_output=True, timeout=60)
    err = proc.stderr.decode()
    lines = dict(line.split(" ", 1) for line in err.splitlines() if line.startswith(("LOADED ", "RC ")))
    assert lines.get("RC") == "0", f"{command} failed: {proc.stdout.decode()} {err}"
    return set(lines.get("LOADED", "").split()), proc.stdout.decode()


def heavy(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded
                  if m.split(".")[0] in FORBIDDEN or m.startswith(FORBIDDEN_OWN))


def test_add_check_del_import_nothing_heavy_after_the_first_call(node):
    conf = node.conf(rails=2)
    first_pod, pod = node.pod(), node.pod()

    first, _ = run_probe(node, "ADD", conf, first_pod, "warm")
    assert "pydantic" in first, "the probe must see the first call's validation (negative control)"

    calls = {}
    calls["ADD"], result = run_probe(node, "ADD", conf, pod, "c1")
    calls["CHECK"], _ = run_probe(node, "CHECK", dict(conf, prevResult=json.loads(result)), pod, "c1")
    calls["DEL"], _ = run_probe(node, "DEL", conf, pod, "c1")
    calls["DEL again (CNI_NETNS='')"], _ = run_probe(node, "DEL", conf, None, "c1")
    for command, loaded in calls.items():
        assert heavy(loaded) == [], f"{command} loaded {heavy(loaded)}: " + \
            "; ".join(f"{m.split('.')[0]}: {FORBIDDEN.get(m.split('.')[0], 'see docs/benchmarks.md')}" for m in heavy(loaded))
    assert "rdma_netns.commands.add" in calls["ADD"], "the probe ran the real ADD"
    # Each mode's code loads only for its own attachments (modes._build).
    assert not any(m.startswith("rdma_netns.modes.exclusive") for loaded in calls.values() for m in loaded)


BARE_PROBE = (  # as the launcher starts Python (-IS: no site, which would import os itself)
    "import sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from rdma_netns import entry\n"
    "env = dict(zip(sys.argv[2::2], sys.argv[3::2]))\n"
    "rc = entry.run_cni(env, sys.stdin.buffer.read())\n"
    "sys.stderr.write('OS %r RC %d\\n' % (sorted(m for m in ('os', 'posixpath', '_collections_abc')"
    " if m in sys.modules), rc))\n"
)


def test_add_never_imports_os(node):
    """`import os` is ~1 ms of a cold interpreter: the whole ADD (IPAM, links, addresses, routing,
    the published files, two state records) runs on posix and util/paths.py. The first call of a
    config is the control: pydantic loads os."""
    import rdma_netns

    packages = str(__import__("pathlib").Path(rdma_netns.__file__).parent.parent)
    conf = node.conf(rails=2)

    def bare_add(pod: str, container_id: str) -> str:
        env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": container_id, "CNI_IFNAME": conf["rails"][0]["ifname"],
               "CNI_NETNS": node.netns_path(pod), "CNI_PATH": "/usr/lib/cni"}
        proc = subprocess.run(["ip", "netns", "exec", node.name, sys.executable, "-IS", "-c", BARE_PROBE, packages,
                               *[item for pair in env.items() for item in pair]],
                              input=json.dumps(conf).encode(), capture_output=True, timeout=60)
        return next((line for line in proc.stderr.decode().splitlines() if line.startswith("OS ")),
                    proc.stderr.decode() + proc.stdout.decode())

    assert bare_add(node.pod(), "warm-os") == "OS ['_collections_abc', 'os', 'posixpath'] RC 0"
    assert bare_add(node.pod(), "c-os") == "OS [] RC 0"
