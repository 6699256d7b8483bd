"""Exclusive RDMA mode on a real kernel: each pod gets its own RDMA device, and it comes back.

Soft-RoCE is deleted when its netdev changes namespace, so the layout follows
shared/real-rdma-kernel.md: a netdev plugin (Debian's Go host-device, as in an SR-IOV setup)
moves the netdev into the pod, an rxe device is created on it from inside the pod (it registers
in the initial namespace), and rdma-netns, chained after host-device, moves that RDMA device
into the pod. The NIC-moving half of exclusive mode is checked with the guest's virtio NICs,
which behave like physical NICs.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from integration.guest_suite.conftest import in_pod, rc_exchange, rdma_devices, sh, timed_cni
from tests.conftest import plugin_path, run_plugin

pytestmark = pytest.mark.guest


def set_mode(mode: str) -> None:
    """Switch the kernel's mode with our own admin command; namespaces of earlier tests may take a
    moment to be destroyed, and until then the kernel answers EBUSY."""
    deadline = time.monotonic() + 60
    while True:
        out = sh(plugin_path(), "mode", "set", mode, check=False)
        if out.returncode == 0:
            return
        assert "blocked" in out.stderr or "cannot change" in out.stderr, out.stderr
        if time.monotonic() > deadline:
            raise AssertionError(f"mode set {mode} kept failing: {out.stderr}")
        time.sleep(1)


@pytest.fixture
def exclusive_kernel():
    for leftover in os.listdir("/var/run/netns") if os.path.isdir("/var/run/netns") else []:
        sh("ip", "netns", "del", leftover, check=False)
    set_mode("exclusive")
    try:
        yield
    finally:
        for leftover in os.listdir("/var/run/netns") if os.path.isdir("/var/run/netns") else []:
            sh("ip", "netns", "del", leftover, check=False)
        set_mode("shared")


def host_device_add(lab, pod: str, device: str, address: str) -> dict:
    """The previous plugin of the chain: host-device moves the netdev in and gives it an address."""
    conf = {"cniVersion": "1.0.0", "name": "hostdev", "type": "host-device", "device": device,
            "ipam": {"type": "static", "addresses": [{"address": address}]}}
    return run_plugin("ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1",
                      timeout=120, plugin="/usr/lib/cni/host-device").ok()


def chained_conf(lab, prev: dict, device: str) -> dict:
    return {"cniVersion": "1.1.0", "name": "rdma-excl", "type": "rdma-netns", "mode": "exclusive",
            "stateDir": str(lab.tmp / "state"), "prevResult": prev, "runtimeConfig": {"deviceID": device},
            "pairing": False}


def test_chained_exclusive_each_pod_owns_its_device_and_rdma_works(lab, exclusive_kernel):
    lab.veth(f"x0{lab.tag}", f"x1{lab.tag}")
    pods = [lab.pod(), lab.pod()]
    addresses = ["fd00:21::1", "fd00:21::2"]
    devices = [f"rxq{lab.tag}0", f"rxq{lab.tag}1"]
    confs = []
    for pod, netdev, address, device in zip(pods, (f"x0{lab.tag}", f"x1{lab.tag}"), addresses, devices):
        prev = host_device_add(lab, pod, netdev, f"{address}/64")
        in_pod(pod, "rdma", "link", "add", device, "type", "rxe", "netdev", "net1")
        assert device in rdma_devices(), "a new rxe registers in the initial namespace"
        conf = chained_conf(lab, prev, device)
        result = timed_cni("exclusive-chained", "ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                           ifname="net1").ok()
        assert result["interfaces"][0]["name"] == "net1" and result["interfaces"][0]["pciID"] == device
        assert result["ips"] == prev["ips"], "the previous result is passed on"
        confs.append(dict(conf, prevResult=result))
    for pod, device in zip(pods, devices):
        assert rdma_devices(pod) == [device], "in exclusive mode a pod sees only its own device"
    assert not set(devices) & set(rdma_devices()), "and the host no longer sees them"

    verdict = rc_exchange(pods[0], addresses[0], pods[1], addresses[1], server_dev=devices[0], client_dev=devices[1])
    assert verdict["ok"]
    for pod, conf in zip(pods, confs):
        timed_cni("exclusive-chained", "CHECK", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                  ifname="net1").ok()

    for pod, conf, device in zip(pods, confs, devices):
        timed_cni("exclusive-chained", "DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                  ifname="net1").ok()
        assert device in rdma_devices(), "DEL brought the RDMA device back to the host"
        assert rdma_devices(pod) == []
        run_plugin("DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1").ok()  # twice
        lab.rxe.append(device)


def one_chained_pod(lab, address: str, device: str) -> tuple[str, dict]:
    """A pod wired like the chained test's, with one RDMA device moved in; returns (pod, conf)."""
    lab.veth(f"x0{lab.tag}", f"x1{lab.tag}")
    pod = lab.pod()
    prev = host_device_add(lab, pod, f"x0{lab.tag}", address)
    in_pod(pod, "rdma", "link", "add", device, "type", "rxe", "netdev", "net1")
    conf = chained_conf(lab, prev, device)
    timed_cni("exclusive-chained", "ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
              ifname="net1").ok()
    return pod, conf


def test_check_notices_a_device_that_left_the_pod(lab, exclusive_kernel):
    device = f"rxc{lab.tag}"
    pod, conf = one_chained_pod(lab, "fd00:22::1/64", device)
    run_plugin("CHECK", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1").ok()
    # Someone moves the device out of the pod behind the plugin's back: a name for the host's
    # namespace, then the rdma tool from inside the pod.
    sh("touch", "/var/run/netns/guesthost")
    sh("mount", "--bind", "/proc/1/ns/net", "/var/run/netns/guesthost")
    try:
        in_pod(pod, "rdma", "dev", "set", device, "netns", "guesthost")
        err = run_plugin("CHECK", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1").error(106)
        assert device in err["msg"]
    finally:
        sh("umount", "/var/run/netns/guesthost", check=False)
        sh("rm", "-f", "/var/run/netns/guesthost", check=False)
    run_plugin("DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1").ok()
    lab.rxe.append(device)


def test_pod_namespace_deleted_without_del(lab, exclusive_kernel):
    device = f"rxd{lab.tag}"
    pod, conf = one_chained_pod(lab, "fd00:23::1/64", device)
    sh("ip", "netns", "del", pod)
    lab.pods.remove(pod)
    timed_cni("exclusive-chained", "DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
              ifname="net1").ok()
    assert not list((lab.tmp / "state" / "rdma-excl").glob("*.json")), "DEL cleaned the state"
    # Soft-RoCE is deleted with its netdev's namespace move (a real NIC's device comes back).
    assert device not in rdma_devices()


def virtio_nics() -> list[str]:
    """The guest's two virtio NICs (run-in-guest.sh --net-loop), joined to each other only."""
    out = []
    for name in sorted(os.listdir("/sys/class/net")):
        try:
            driver = os.path.basename(os.readlink(f"/sys/class/net/{name}/device/driver"))
        except OSError:
            continue
        if driver == "virtio_net":
            out.append(name)
    return out


@pytest.mark.skipif(len(virtio_nics()) < 2, reason="the guest was booted without --net-loop")
def test_exclusive_moves_a_physical_nic_in_and_back_even_after_the_pod_died(lab, exclusive_kernel):
    nic, peer = virtio_nics()[:2]
    mac = json.loads(sh("ip", "-j", "link", "show", nic).stdout)[0]["address"]
    # The QEMU hub stalls a sender while any other port cannot receive, and a virtio NIC that is
    # down has no receive buffers: the pod's first frame (its neighbour announcement) would sit in
    # the NIC's TX queue for good, holding a reference that keeps the dead pod's namespace (and so
    # the NIC) from ever being dismantled. A real wire takes the frame; the peer up makes this one.
    sh("ip", "link", "set", peer, "up")
    try:
        conf = {"cniVersion": "1.1.0", "name": "nic-excl", "type": "rdma-netns", "mode": "exclusive",
                "requireRdma": False, "stateDir": str(lab.tmp / "state"), "pairing": False,
                "rails": [{"netdev": nic, "ifname": "rdma0", "ipam": lab.ipam("fd00:31::/64")}]}
        pod = lab.pod()
        timed_cni("exclusive-nic", "ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="rdma0").ok()
        assert json.loads(in_pod(pod, "ip", "-j", "link", "show", "rdma0").stdout)[0]["address"] == mac
        sh("ip", "netns", "del", pod)
        lab.pods.remove(pod)
        # The kernel hands a physical NIC back to the host when its namespace dies, under the pod's
        # name (or dev<N>); DEL finds it by MAC and gives it back its own name.
        timed_cni("exclusive-nic", "DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="rdma0").ok()
        back = json.loads(sh("ip", "-j", "link", "show", nic).stdout)[0]
        assert back["address"] == mac
    finally:
        sh("ip", "link", "set", peer, "down")  # alone on the hub again, its frames would stall
