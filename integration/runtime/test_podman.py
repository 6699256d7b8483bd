"""rdma-netns with a real container runtime as its client: Debian 12's Podman 4.3, CNI backend.

Podman runs rootful with private storage and a private containers.conf (podman_rig.py); its CNI
plugin folder holds the installed rdma-netns launcher behind cni-record.sh, which records each
call's CNI_* environment and stdin. The rails are two veth pairs in the root netns, where
Podman's CNI calls run. Every test proves ADD (interfaces, addresses, state, leases) and DEL
(nothing left on the host, in the plugin's state, in host-local's leases or in libcni's cache),
and asserts on exactly what Podman sent.

Skipped only when Podman cannot be installed (setup-podman.sh is run if it is missing) or cannot
run a container here at all (`--network none`, no plugin involved).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from integration.runtime.conftest import PODMAN_REPORT
from integration.runtime.podman_rig import (
    HERE, IMAGE, PodmanRig, container_ipv6, host_links, host_rules, static_busybox)
from tests.conftest import CNI_BIN_DIR, installed_executable

pytestmark = pytest.mark.netns

RAIL_SUBNETS = ["fd00:5a::/64", "fd00:5b::/64"]
CNI_ENV_KEYS = {"CNI_ARGS", "CNI_COMMAND", "CNI_CONTAINERID", "CNI_IFNAME", "CNI_NETNS", "CNI_PATH"}


def _podman_ready() -> str | None:
    """None when podman and its helpers are here (installing them if missing), else why not."""
    if os.geteuid() != 0:
        return "needs root (rootful podman, veth rails in the root netns)"
    if not (shutil.which("podman") and shutil.which("conmon") and static_busybox()
            and os.path.exists(f"{CNI_BIN_DIR}/host-local")):
        proc = subprocess.run([str(HERE / "setup-podman.sh")], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            return f"podman could not be installed: integration/runtime/setup-podman.sh failed:\n{proc.stderr[-2000:]}"
    return None


@pytest.fixture(scope="module")
def rig():
    why = _podman_ready()
    if why:
        pytest.skip(why)
    r = PodmanRig(installed_executable())
    try:
        r.import_image()
        smoke = r.podman("run", "--rm", "--network", "none", IMAGE, "true", check=False)
        if smoke.returncode != 0:
            pytest.skip(f"podman cannot run a container on this machine (--network none, runtime "
                        f"{r.runtime}): {smoke.stderr.strip()}")
        version = r.podman("version", "--format", "{{.Client.Version}}").stdout.strip()
        backend = r.podman("info", "--format", "{{.Host.NetworkBackend}}").stdout.strip()
        PODMAN_REPORT.append(f"podman {version}, network backend {backend}, OCI runtime {r.runtime}, "
                             f"storage vfs in {r.work}")
        yield r
    finally:
        r.close()


def _calls_for(rig: PodmanRig, container_id: str):
    return [c for c in rig.calls() if c.env.get("CNI_CONTAINERID") == container_id]


def _expected_stdin(conflist: dict) -> dict:
    """What libcni sends a plugin of a one-plugin list: the entry plus the list's name and version."""
    return dict(conflist["plugins"][0], name=conflist["name"], cniVersion=conflist["cniVersion"])


def _in(address: str, subnet: str) -> bool:
    return ipaddress.ip_interface(address).ip in ipaddress.ip_network(subnet)


def _ping(rig: PodmanRig, name: str, src: str, dst: str) -> None:
    out = rig.exec(name, "ping", "-6", "-c", "2", "-i", "0.2", "-W", "2", "-I", src, dst, check=False)
    assert out.returncode == 0 and " 0% packet loss" in out.stdout, f"{name}: ping {src} -> {dst}\n{out.stdout}{out.stderr}"


def _save_sample(rig: PodmanRig, ids: dict[str, str], path: Path) -> list[dict]:
    """The recorded calls, with container IDs shortened to 12 characters and the rig folder as $RIG."""
    def shorten(text: str) -> str:
        for full in ids.values():
            text = text.replace(full, full[:12])
        return text.replace(str(rig.work), "$RIG")

    sample = []
    for call in rig.calls():
        if call.command != "VERSION" and call.env.get("CNI_CONTAINERID") not in ids.values():
            continue
        sample.append({"command": call.command,
                       "env": {k: shorten(v) for k, v in call.env.items()},
                       "stdin": json.loads(shorten(call.stdin.decode()))})
    path.write_text(json.dumps(sample, indent=2) + "\n")
    return sample


def test_podman_add_ping_del_over_two_rails(rig, tmp_path_factory):
    net = f"rdpm-{rig.tag}"
    conflist = rig.add_network(net, RAIL_SUBNETS, capabilities={"deviceID": True, "mac": True})
    assert net in rig.podman("network", "ls", "--format", "{{.Name}}").stdout.split()
    links_before, rules_before = host_links(), host_rules()

    names = {"a": f"rdpm-a-{rig.tag}", "b": f"rdpm-b-{rig.tag}"}
    ids, started = {}, {}
    for key, name in names.items():
        proc, started[key] = rig.run(name, "--network", net)
        ids[key] = proc.stdout.strip()

    # ADD happened: both rails in each container, addresses from the rails' subnets
    addrs = {}
    for key, name in names.items():
        found = container_ipv6(rig, name)
        # the pod's only network: rail 0 takes CNI_IFNAME (eth0), as a CRI runtime needs
        assert set(found) == {"lo", "eth0", "rdma1"}, f"{name}: interfaces {found}"
        for ifname, subnet in zip(("eth0", "rdma1"), RAIL_SUBNETS):
            assert len(found[ifname]) == 1 and _in(found[ifname][0], subnet), found
        addrs[key] = [found["eth0"][0], found["rdma1"][0]]
        # ... and Podman understood the plugin's result
        settings = rig.inspect(name)["NetworkSettings"]["Networks"][net]
        assert settings["GlobalIPv6Address"] == addrs[key][0].split("/")[0]
        assert [s["Addr"] for s in settings["SecondaryIPv6Addresses"]] == [addrs[key][1].split("/")[0]]
    assert rig.state_files(net) == sorted(f"{ids[k]}:eth0.json" for k in ids)
    assert len(rig.leases(net)) == 4
    assert host_links() == links_before, "a pod interface showed up in the host namespace"
    assert host_rules() == rules_before, "the host's routing rules changed"

    # traffic between the two containers over each rail, both ways
    for rail in range(2):
        _ping(rig, names["a"], addrs["a"][rail].split("/")[0], addrs["b"][rail].split("/")[0])
        _ping(rig, names["b"], addrs["b"][rail].split("/")[0], addrs["a"][rail].split("/")[0])

    # stop -> DEL; rm -> nothing more
    sandboxes = {k: rig.inspect(n)["NetworkSettings"]["SandboxKey"] for k, n in names.items()}
    stopped = {}
    for key, name in names.items():
        start = time.perf_counter()
        rig.podman("stop", name)
        stopped[key] = time.perf_counter() - start
        assert [c.command for c in _calls_for(rig, ids[key])] == ["ADD", "DEL"]
    for name in names.values():
        rig.podman("rm", name)
    assert rig.state_files(net) == []
    assert rig.leases(net) == []
    assert rig.libcni_cache(net) == []
    assert host_links() == links_before
    assert host_rules() == rules_before
    assert not any(os.path.exists(s) for s in sandboxes.values())

    # what Podman sent
    for key, name in names.items():
        add, delete = _calls_for(rig, ids[key])
        for call in (add, delete):
            assert set(call.env) == CNI_ENV_KEYS
            assert call.env["CNI_IFNAME"] == "eth0"
            assert call.env["CNI_NETNS"] == sandboxes[key]
            assert call.env["CNI_PATH"] == rig.cni_path
            assert call.env["CNI_ARGS"] == f"IgnoreUnknown=1;K8S_POD_NAME={name}"
            assert "CONTAINERS_CONF" in call.env_names, "libcni passes the runtime's own environment on"
        assert add.conf == _expected_stdin(conflist), "ADD: no runtimeConfig, no prevResult, nothing else"
        del_conf = dict(delete.conf)
        prev = del_conf.pop("prevResult")
        assert del_conf == _expected_stdin(conflist)
        assert prev["cniVersion"] == "1.0.0"
        assert [i["name"] for i in prev["interfaces"]] == ["eth0", "rdma1"]
        assert {i["sandbox"] for i in prev["interfaces"]} == {sandboxes[key]}
        assert [ip["address"] for ip in prev["ips"]] == addrs[key]
    versions = [c for c in rig.calls() if c.command == "VERSION"]
    assert versions, "libcni asks the plugin VERSION before its calls"
    for call in versions:
        assert json.loads(call.stdin) == {"cniVersion": "1.0.0"}
        assert call.env["CNI_CONTAINERID"] == "" and call.env["CNI_IFNAME"] == "dummy"

    sample = tmp_path_factory.mktemp("podman") / "podman-cni-calls.json"
    _save_sample(rig, ids, sample)
    if os.environ.get("RDMA_NETNS_PODMAN_SAMPLE"):
        _save_sample(rig, ids, Path(os.environ["RDMA_NETNS_PODMAN_SAMPLE"]))
    PODMAN_REPORT.append(f"two rails: podman run -d took {started['a']:.2f} s (first ADD of a new config) "
                         f"and {started['b']:.2f} s; podman stop (DEL) {stopped['a']:.2f} s and {stopped['b']:.2f} s")
    PODMAN_REPORT.append(f"recorded calls: {sample}")


def test_podman_start_time_with_the_plugin(rig):
    """`podman run -d` wall time, warm, with the two-rail rdma-netns network and with none."""
    net = f"rdpmt-{rig.tag}"
    rig.add_network(net, ["fd00:5d::/64", "fd00:5e::/64"])
    rig.run(f"rdpm-warm-{rig.tag}", "--network", net)  # first ADD of the config: pydantic, cached
    rig.podman("rm", "-f", "-t", "0", f"rdpm-warm-{rig.tag}")
    times: dict[str, list[float]] = {"none": [], net: []}
    for i in range(3):
        for network in times:
            name = f"rdpm-t{i}-{network[:4]}-{rig.tag}"
            times[network].append(rig.run(name, "--network", network)[1])
            rig.podman("rm", "-f", "-t", "0", name)
    assert rig.state_files(net) == [] and rig.leases(net) == []
    none, with_plugin = statistics.median(times["none"]), statistics.median(times[net])
    PODMAN_REPORT.append(f"podman run -d, median of 3: --network none {none:.2f} s, "
                         f"two-rail rdma-netns {with_plugin:.2f} s (+{with_plugin - none:.2f} s)")
    assert with_plugin - none < 2.0, times


def test_podman_43_refuses_a_cni_1_1_0_result_and_its_del_cleans_up(rig):
    """Podman 4.3's libcni (1.1.x) knows spec versions up to 1.0.0: with a 1.1.0 conflist the
    plugin's ADD succeeds, libcni cannot parse the result, and Podman runs DEL at once."""
    net = f"rdpm11-{rig.tag}"
    conflist = rig.add_network(net, RAIL_SUBNETS, version="1.1.0")
    name = f"rdpm-v11-{rig.tag}"
    proc, _ = rig.run(name, "--network", net, check=False)
    assert proc.returncode != 0
    assert 'unsupported CNI result version "1.1.0"' in proc.stderr, proc.stderr
    container_id = rig.podman("inspect", "--format", "{{.Id}}", name).stdout.strip()
    calls = _calls_for(rig, container_id)
    assert [c.command for c in calls] == ["ADD", "DEL"]
    assert calls[0].conf == _expected_stdin(conflist)
    assert "prevResult" not in calls[1].conf, "nothing to pass on: libcni could not read the result"
    rig.podman("rm", "-f", name)
    assert rig.state_files(net) == []
    assert rig.leases(net) == []
    assert rig.libcni_cache(net) == []
    PODMAN_REPORT.append('cniVersion 1.1.0: podman 4.3 says `unsupported CNI result version "1.1.0"` '
                         "after ADD and runs DEL; nothing left")


def _one_rail_static(rig: PodmanRig, suffix: str):
    net = f"rdpm1{suffix}-{rig.tag}"
    conflist = rig.add_network(net, ["fd00:5c::/64"], capabilities={"mac": True, "ips": True},
                               rail_ifnames=False)
    name = f"rdpm-static{suffix}-{rig.tag}"
    mac, ip6 = "02:5a:00:00:00:42", "fd00:5c::42"
    proc, _ = rig.run(name, "--network", net, "--mac-address", mac, "--ip6", ip6)
    return net, conflist, name, proc.stdout.strip(), mac, ip6


def test_podman_static_ip_reaches_host_local_through_cni_args(rig):
    """`--ip6`/`--mac-address`: Podman 4.3 puts them in CNI_ARGS (IP=, MAC=), never in
    runtimeConfig, even though the plugin declares the `ips` and `mac` capabilities. host-local
    reads IP= from the environment the plugin passes on, so the address is honoured."""
    net, conflist, name, container_id, mac, ip6 = _one_rail_static(rig, "s")
    try:
        found = container_ipv6(rig, name)
        assert found["eth0"] == [f"{ip6}/64"], found  # a lone rail without ifname takes CNI_IFNAME
        (add,) = _calls_for(rig, container_id)
        assert add.env["CNI_ARGS"] == f"IgnoreUnknown=1;K8S_POD_NAME={name};MAC={mac};IP={ip6}"
        assert add.conf == _expected_stdin(conflist), "no runtimeConfig"
        assert add.conf["capabilities"] == {"mac": True, "ips": True}
        actual_mac = rig.inspect(name)["NetworkSettings"]["Networks"][net]["MacAddress"]
        PODMAN_REPORT.append(f"--ip6 {ip6} --mac-address {mac}: sent as CNI_ARGS; address applied, "
                             f"container MAC {actual_mac}")
    finally:
        rig.podman("rm", "-f", "-t", "0", name)
    assert [c.command for c in _calls_for(rig, container_id)] == ["ADD", "DEL"]
    assert rig.state_files(net) == [] and rig.leases(net) == []


def test_podman_mac_address_is_applied(rig):
    """Podman 4.3 sends --mac-address as CNI_ARGS MAC=, which rdma-netns honours."""
    net, _, name, container_id, mac, _ = _one_rail_static(rig, "m")
    try:
        out = rig.exec(name, "cat", "/sys/class/net/eth0/address").stdout.strip()
    finally:
        rig.podman("rm", "-f", "-t", "0", name)
        assert rig.state_files(net) == [] and rig.leases(net) == []
    assert out == mac
