"""The admin command for the kernel's RDMA netns mode, and the plugin's mode checks."""

from __future__ import annotations

import os

import pytest

from integration.guest_suite.conftest import sh, timed_cni
from rdma_netns.kernel import rdma_sysfs
from tests.conftest import plugin_path

pytestmark = pytest.mark.guest


def test_mode_change_is_refused_while_a_namespace_exists_and_names_it(lab, tmp_path):
    pod = lab.pod()
    assert rdma_sysfs.netns_mode() == "shared"
    show = sh(plugin_path(), "mode")
    assert "shared" in show.stdout and pod in show.stdout, show.stdout
    out = sh(plugin_path(), "mode", "set", "exclusive", check=False)
    assert out.returncode == 1 and pod in out.stderr, out.stderr
    assert rdma_sysfs.netns_mode() == "shared", "the mode did not change"

    modprobe = tmp_path / "rdma-netns.conf"
    out = sh(plugin_path(), "mode", "set", "exclusive", "--persist", "--modprobe-file", str(modprobe), check=False)
    assert out.returncode == 0 and "options ib_core netns_mode=0" in modprobe.read_text()
    assert "reboot" in out.stdout


def test_mode_change_works_without_namespaces_and_the_plugin_checks_the_mode(lab):
    for leftover in os.listdir("/var/run/netns") if os.path.isdir("/var/run/netns") else []:
        sh("ip", "netns", "del", leftover, check=False)
    from integration.guest_suite.test_2_exclusive import set_mode

    set_mode("exclusive")
    try:
        assert rdma_sysfs.netns_mode() == "exclusive"
        lab.veth(f"m0{lab.tag}", f"m1{lab.tag}")
        pod = lab.pod()
        conf = {"cniVersion": "1.1.0", "name": "wrong-mode", "type": "rdma-netns", "mode": "shared",
                "requireRdma": False, "stateDir": str(lab.tmp / "state"), "pairing": False,
                "rails": [{"netdev": f"m0{lab.tag}", "ipam": lab.ipam("fd00:41::/64")}]}
        err = timed_cni("mode-check", "ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                        ifname="net1").error(103)
        assert "exclusive" in err["msg"]
        status = timed_cni("mode-check", "STATUS", conf)
        status.error(50)
    finally:
        for pod in list(lab.pods):
            sh("ip", "netns", "del", pod, check=False)
            lab.pods.remove(pod)
        set_mode("shared")
    assert rdma_sysfs.netns_mode() == "shared"
