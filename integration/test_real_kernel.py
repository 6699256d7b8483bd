"""The real-kernel suite: boots a Debian 7.x kernel under QEMU (integration/guest/) and runs
integration/guest_suite there, on a real RDMA subsystem with Soft-RoCE devices.

Two guest boots: the kernel's default (shared) mode runs the suite (one boot for the whole
session), and a second boot with `ib_core.netns_mode=0` on the kernel command line runs
test_5_exclusive_boot.py (exclusive mode end to end: device plugin, stand-in kubelet, CNI) and
test_8_exclusive_dra.py (exclusive mode through DRA: the real API server and scheduler of the
cluster suite's build, run inside that guest).
Each guest test then shows up here as its own test,
from the guest's JUnit report. A test that did not run in the guest fails here: nothing is
skipped silently. Without a fetched kernel the suite is skipped on a developer machine and
fails in CI (CI=true); scripts/test.sh fetches the kernel first.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from integration.cluster.guest_node import stage
from integration.conftest import GUEST_REPORT

REPO = Path(__file__).resolve().parent.parent
GUEST = REPO / "integration" / "guest"
KERNEL_ENV = Path(os.environ.get("RDMA_NETNS_KERNEL_CACHE", "/var/cache/rdma-netns-kernel")) / "kernel.env"
GUEST_TIMEOUT = int(os.environ.get("RDMA_NETNS_GUEST_TIMEOUT", "3000"))

EXPECTED = [
    "test_0_rdma_netlink::test_rdma_netlink_clients_against_the_kernel",
    "test_1_shared::test_shared_mode_two_pods_gids_and_rdma_traffic[macvlan]",
    "test_1_shared::test_shared_mode_two_pods_gids_and_rdma_traffic[ipvlan]",
    "test_1_shared::test_del_removes_the_pods_gid",
    "test_1_shared::test_shared_mode_refuses_a_rail_without_rdma_device",
    "test_1_shared::test_rc_with_no_traffic_on_the_rail_first",
    "test_1_shared::test_without_link_local_only_a_peer_other_traffic_resolved_connects",
    "test_2_exclusive::test_chained_exclusive_each_pod_owns_its_device_and_rdma_works",
    "test_2_exclusive::test_check_notices_a_device_that_left_the_pod",
    "test_2_exclusive::test_pod_namespace_deleted_without_del",
    "test_2_exclusive::test_exclusive_moves_a_physical_nic_in_and_back_even_after_the_pod_died",
    "test_3_mode_switch::test_mode_change_is_refused_while_a_namespace_exists_and_names_it",
    "test_3_mode_switch::test_mode_change_works_without_namespaces_and_the_plugin_checks_the_mode",
    "test_4_device_plugin::test_dp_shared_advertises_the_real_rxe_devices_and_allocates_their_uverbs",
    "test_4_device_plugin::test_dp_confined_container_opens_only_its_device_and_port_down_turns_units_unhealthy",
    "test_4_device_plugin::test_dp_exclusive_mode_follows_the_kernel_mode",
    "test_6_pod_gids::test_two_pods_get_their_own_gid_index_on_both_rails",
    "test_6_pod_gids::test_unequal_table_layouts_leave_the_index_unset",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[netdev-macvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[netdev-ipvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[rdmaDevice-macvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[rdmaDevice-ipvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[pciAddress-macvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[pciAddress-ipvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[pciAddressBackup-macvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[pciAddressBackup-ipvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[none-macvlan]",
    "test_7_bond::test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device[none-ipvlan]",
    "test_7_bond::test_no_link_local_with_the_config_key",
    "test_7_bond::test_a_full_gid_table_fails_add_with_104_and_leaves_nothing",
    "test_add_del::test_ipvlan_link",
]
EXPECTED_EXCLUSIVE_BOOT = [
    "test_5_exclusive_boot::test_granted_devices_move_into_their_pods_and_carry_rc_traffic",
    "test_5_exclusive_boot::test_pod_whose_namespace_died_first_gives_its_nic_and_device_back",
    "test_8_exclusive_dra::test_the_scheduler_gives_each_device_one_claim_and_the_cni_moves_exactly_it",
]


class GuestRun:
    def __init__(self, results: Path, returncode: int, seconds: float) -> None:
        self.results, self.returncode, self.seconds = results, returncode, seconds
        self.outcomes: dict[str, tuple[str, str]] = {}
        for report in sorted(results.glob("*.xml")):
            for case in ET.parse(report).getroot().iter("testcase"):
                module = case.get("classname", "").rsplit(".", 1)[-1]
                key = f"{module}::{case.get('name')}"
                failed = case.find("failure") if case.find("failure") is not None else case.find("error")
                skipped = case.find("skipped")
                if failed is not None:
                    self.outcomes[key] = ("failed", (failed.get("message") or "") + "\n" + (failed.text or ""))
                elif skipped is not None:
                    self.outcomes[key] = ("skipped", skipped.get("message") or "")
                else:
                    self.outcomes[key] = ("passed", "")


def boot_guest(tmp_path_factory, label: str, guest_args: list[str], suite_args: list[str],
               staged: dict[str, list[Path]] | None = None) -> GuestRun:
    """`staged`: files the guest needs from this machine, linked into a folder of the results
    (the guest's $GUEST_RESULTS; the rest of its root is this machine's without /var/cache)."""
    if not KERNEL_ENV.exists():
        message = f"no guest kernel ({KERNEL_ENV} missing): run sudo integration/guest/fetch-kernel.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    results = tmp_path_factory.mktemp(label)
    for folder, paths in (staged or {}).items():
        (results / folder).mkdir()
        for path in paths:
            stage(path, results / folder)
    start = time.monotonic()
    proc = subprocess.run([str(GUEST / "run-in-guest.sh"), "--timeout", str(GUEST_TIMEOUT), "--net-loop",
                           *guest_args, "--results", str(results), "--",
                           "bash", str(GUEST / "run-suite.sh"), *suite_args],
                          cwd=REPO, stdin=subprocess.DEVNULL)
    run = GuestRun(results, proc.returncode, time.monotonic() - start)
    attempts = (results / "boot-attempts").read_text().strip() if (results / "boot-attempts").exists() else "1"
    retried = "" if attempts == "1" else \
        f"; booted on attempt {attempts}, the failed boots' consoles are console.attempt*.log"
    GUEST_REPORT.append(f"{label} run: exit {proc.returncode} after {run.seconds:.0f} s (boot included{retried}); "
                        f"console and reports: {results}")
    GUEST_REPORT.extend(timing_summary(results / "timings.jsonl"))
    for facts in (results / "exclusive-boot-facts.jsonl", results / "pod-gids-facts.jsonl"):
        if facts.exists():
            GUEST_REPORT.extend(f"  {line}" for line in facts.read_text().splitlines())
    return run


@pytest.fixture(scope="session")
def guest_run(tmp_path_factory) -> GuestRun:
    return boot_guest(tmp_path_factory, "guest", [], [])


@pytest.fixture(scope="session")
def guest_run_exclusive_boot(tmp_path_factory) -> GuestRun:
    """The second boot: the kernel comes up in exclusive mode, as a node with
    `options ib_core netns_mode=0` does. Its DRA test runs the control plane of the cluster
    suite's Kubernetes build (waited for here: the test command starts it in the background);
    3G for it beside the suite."""
    from integration.cluster.cluster import build_binaries

    kube = build_binaries() if KERNEL_ENV.exists() else None
    programs = [kube / name for name in ("etcd", "kube-apiserver", "kube-scheduler")] if kube else []
    return boot_guest(tmp_path_factory, "guest-exclusive-boot",
                      ["--kernel-arg", "ib_core.netns_mode=0", "--memory", "3G"], ["exclusive-boot"],
                      staged={"kube-bin": programs})


def timing_summary(path: Path) -> list[str]:
    """Median wall time per plugin call kind inside the guest (software emulation: ~20-50x slower
    than native; the first call of a new config includes its one-time pydantic validation)."""
    if not path.exists():
        return []
    by_name: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        by_name.setdefault(entry["name"], []).append(entry["ms"])
    return [f"  {name:<28} median {statistics.median(ms):8.0f} ms  (n={len(ms)}, min {min(ms):.0f})"
            for name, ms in sorted(by_name.items())]


def assert_booted_and_reported(run: GuestRun, label: str) -> None:
    assert run.returncode not in (124, 125), \
        f"the {label} did not boot or timed out (exit {run.returncode}); see {run.results}/console.log"
    assert run.outcomes, f"the {label} wrote no test report; see {run.results}/console.log"


def assert_passed_in_guest(run: GuestRun, name: str) -> None:
    outcome, detail = run.outcomes.get(name, ("missing", "the test did not run in the guest"))
    assert outcome == "passed", f"{name}: {outcome}\n{detail}"


def test_the_guest_booted_and_ran_the_suite(guest_run):
    assert_booted_and_reported(guest_run, "guest")


@pytest.mark.parametrize("name", EXPECTED)
def test_in_guest(guest_run, name):
    assert_passed_in_guest(guest_run, name)


def test_the_exclusive_boot_guest_booted_and_ran(guest_run_exclusive_boot):
    assert_booted_and_reported(guest_run_exclusive_boot, "exclusive-boot guest")


@pytest.mark.parametrize("name", EXPECTED_EXCLUSIVE_BOOT)
def test_in_exclusive_boot_guest(guest_run_exclusive_boot, name):
    assert_passed_in_guest(guest_run_exclusive_boot, name)
