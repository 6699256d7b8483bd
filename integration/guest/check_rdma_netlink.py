"""Guest side of test_0_rdma_netlink: the project's one NETLINK_RDMA client, kernel/rdma_nldev.py
(its RdmaNetlink connection and the CNI hot path's device_index/move_device), against the real
RDMA core (Soft-RoCE on kernel 7.3+), cross-checked with `rdma` and sysfs.

Only for the guest: it switches the system-wide RDMA netns mode and makes links and namespaces.
Prints "CHECK <name>: PASS|FAIL ..." and "INFO <name>: ..." lines, "PHASE <name> <seconds>" timings
and a final count; exits 1 when a check failed.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

T0 = time.monotonic()
from rdma_netns.kernel import netns, rdma_nldev, rdma_sysfs  # noqa: E402
from rdma_netns.kernel.netlink import NetlinkError, NetlinkSocket, attr_str  # noqa: E402
from rdma_netns.kernel.rdma_nldev import NldevPort, RdmaBusy, RdmaError, RdmaNetlink  # noqa: E402

IMPORT_SECONDS = time.monotonic() - T0
FAILED: list[str] = []
PASSED: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> bool:
    (PASSED if ok else FAILED).append(name)
    print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} {detail}".rstrip(), flush=True)
    return ok


def info(name: str, detail: object) -> None:
    print(f"INFO {name}: {detail}", flush=True)


@contextmanager
def phase(name: str) -> Iterator[None]:
    start = time.monotonic()
    print(f"== {name}", flush=True)
    try:
        yield
    except Exception as exc:  # a crash in a phase is a failed check, and the rest still runs
        check(f"{name}-completed", False, f"{type(exc).__name__}: {exc}")
    print(f"PHASE {name} {time.monotonic() - start:.1f}s", flush=True)


def sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def refused(name: str, call: Callable[[], object], code: int, text: str = "",
            kind: type[Exception] = RdmaError) -> Exception | None:
    """Check that `call` raises `kind` with errno `code` and `text` in its message."""
    try:
        call()
    except kind as exc:
        ok = exc.errno == code and text in str(exc)
        check(name, ok, f"errno {errno.errorcode.get(exc.errno, exc.errno)}: {exc}")
        return exc
    except Exception as exc:  # noqa: BLE001 - reported as the failure it is
        check(name, False, f"{type(exc).__name__}: {exc}")
        return None
    check(name, False, f"no error (wanted {errno.errorcode[code]})")
    return None


def wait_for(what: Callable[[], bool], seconds: float = 30) -> float:
    """Poll until `what` is true; the time it took (-1 on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if what():
            return time.monotonic() - start
        time.sleep(0.2)
    return -1


def set_mode_when_free(rn: RdmaNetlink, mode: str) -> tuple[float, int]:
    """set_netns_mode, retrying while deleted namespaces are still torn down (asynchronously)."""
    busy = 0
    start = time.monotonic()
    while True:
        try:
            rn.set_netns_mode(mode)
            return time.monotonic() - start, busy
        except RdmaBusy:
            busy += 1
            if time.monotonic() - start > 60:
                raise
            time.sleep(0.2)


def sysfs_port(port: NldevPort) -> str:
    return f"/sys/class/infiniband/{port.device_name}/ports/{port.port_index}"


def rdma_json(*argv: str) -> list[dict]:
    return json.loads(sh("rdma", "-j", *argv) or "[]")


# ------------------------------------------------------------------------------ the checks

def devices_and_ports(rn: RdmaNetlink) -> dict[str, int]:
    rn.link_add("rxe0", "rxe", "v0")
    rn.link_add("rxe1", "rxe", "v1")
    tool = {d["ifname"]: d for d in rdma_json("dev")}
    mine = {d.name: d for d in rn.devices()}
    check("link-add-rxe0-rxe1", {"rxe0", "rxe1"} <= set(tool), f"rdma dev lists {sorted(tool)}")
    check("devices-match-rdma-dev", set(mine) == set(tool) and all(
        mine[n].index == tool[n]["ifindex"] and mine[n].node_guid == tool[n]["node_guid"]
        for n in tool), f"{list(mine.values())}")
    check("devices-match-sysfs", all(
        mine[n].node_guid == read(f"/sys/class/infiniband/{n}/node_guid")
        and mine[n].ports == len(rdma_sysfs.ports(n)) and mine[n].protocol == "roce"
        for n in mine) and sorted(mine) == rdma_sysfs.devices())
    rxe0 = mine["rxe0"]
    check("device-by-name-and-index", rn.device("rxe0") == rn.device(rxe0.index) == rxe0, rxe0)
    refused("device-absent-name", lambda: rn.device("nosuch0"), errno.ENODEV, "no RDMA device")
    refused("device-absent-index", lambda: rn.device(9999), errno.EINVAL, "no RDMA device with")

    links = {(p["ifname"], p["port"]): p for p in rdma_json("link")}
    ports = rn.ports()
    info("ports", ports)
    check("ports-match-rdma-link", len(ports) == len(links) and all(
        (p.device_name, p.port_index) in links
        and links[p.device_name, p.port_index]["state"] == p.state_name
        and links[p.device_name, p.port_index]["physical_state"] == p.phys_state_name
        and links[p.device_name, p.port_index].get("netdev") == p.netdev_name for p in ports))
    check("ports-match-sysfs", all(
        read(f"{sysfs_port(p)}/state") == f"{p.state}: {p.state_name}"
        and int(read(f"{sysfs_port(p)}/phys_state").split(":")[0]) == p.phys_state
        and p.netdev_index == int(read(f"/sys/class/net/{p.netdev_name}/ifindex")) for p in ports))
    check("ports-of-one-device", [p.device_name for p in rn.ports("rxe1")] == ["rxe1"])

    refused("link-add-missing-netdev", lambda: rn.link_add("rxe9", "rxe", "nosuch0"), errno.ENODEV)
    refused("link-add-same-netdev-twice", lambda: rn.link_add("rxe9", "rxe", "v0"), errno.EEXIST)
    refused("link-add-unknown-type", lambda: rn.link_add("foo9", "nosuchtype", "v0"), errno.EINVAL)
    return {name: dev.index for name, dev in mine.items()}


def chardevs(rn: RdmaNetlink, index: int, name: str) -> None:
    dev = rn.chardev(index)
    base = f"/sys/class/infiniband_verbs/{dev.name}"
    check("chardev-uverbs-matches-sysfs",
          read(f"{base}/ibdev") == name and read(f"{base}/dev") == f"{dev.major}:{dev.minor}"
          and dev.abi == int(read(f"{base}/abi_version")), dev)
    info("uverbs-abi", f"GET_CHARDEV abi {dev.abi} is the driver's uverbs ABI ({base}/abi_version);"
                       f" the class-wide /sys/class/infiniband_verbs/abi_version says "
                       f"{read('/sys/class/infiniband_verbs/abi_version')}")
    try:
        cm = rn.chardev(None, "rdma_cm")
        check("chardev-rdma-cm-matches-sysfs",
              read("/sys/class/misc/rdma_cm/dev") == f"{cm.major}:{cm.minor}", cm)
    except RdmaError as exc:
        check("chardev-rdma-cm-matches-sysfs", False, exc)
    refused("chardev-unknown-type", lambda: rn.chardev(index, "nosuch"), errno.EOPNOTSUPP,
            "no char device of that type")


def stdlib_lookups(index: int) -> None:
    with NetlinkSocket(rdma_nldev.NETLINK_RDMA) as sock:
        check("nldev-device-index", rdma_nldev.device_index(sock, "rxe0") == index)
        check("nldev-device-index-absent", rdma_nldev.device_index(sock, "nosuch0") is None)
        # what the kernel does with a GET by name: why device_index and RdmaNetlink.device dump instead
        try:
            sock.query(rdma_nldev.nldev_type(rdma_nldev.RDMA_NLDEV_CMD_GET),
                       attr_str(rdma_nldev.RDMA_NLDEV_ATTR_DEV_NAME, "rxe0"), what="GET by name")
            check("kernel-get-by-name-refused", False, "the kernel answered a GET by name")
        except NetlinkError as exc:
            check("kernel-get-by-name-refused", exc.errno == errno.EINVAL, exc)


def shared_mode_refusals(rn: RdmaNetlink, index: int) -> None:
    """Moving into another netns is refused in shared mode; "moving" into its own is a no-op."""
    sh("ip", "netns", "add", "other1")
    other_fd = netns.open_netns("/var/run/netns/other1")
    host_fd = netns.current_netns_fd()
    try:
        refused("move-in-shared-mode", lambda: rn.move_device(index, other_fd), errno.EOPNOTSUPP,
                "driver cannot change namespace")
        with NetlinkSocket(rdma_nldev.NETLINK_RDMA) as sock:
            refused("nldev-move-in-shared-mode",
                    lambda: rdma_nldev.move_device(sock, index, other_fd), errno.EOPNOTSUPP,
                    "or the kernel is in shared mode")
        rn.move_device(index, host_fd)
        check("move-to-own-netns-is-a-noop", rn.device(index).name == "rxe0",
              "SET with the device's current netns succeeds even in shared mode")
    finally:
        os.close(other_fd)
        os.close(host_fd)
        sh("ip", "netns", "del", "other1")


def without_cap_net_admin(index: int) -> None:
    """A forked child that dropped root (so its sockets lack CAP_NET_ADMIN) tries SYS_SET and SET."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            results = []
            for call in (lambda: RdmaNetlink().set_netns_mode("exclusive"),
                         lambda: rdma_nldev.move_device(
                             NetlinkSocket(rdma_nldev.NETLINK_RDMA), index, 0)):
                try:
                    call()
                    results.append([0, "no error"])
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    results.append([getattr(exc, "errno", None), f"{type(exc).__name__}: {exc}"])
            os.write(write_end, json.dumps(results).encode())
        finally:
            os._exit(0)  # never run the parent's code in the child
    os.close(write_end)
    with os.fdopen(read_end) as f:
        results = json.loads(f.read() or "[]")
    os.waitpid(pid, 0)
    for name, (code, text) in zip(("mode-set-eperm", "nldev-move-eperm"), results, strict=True):
        check(name, code == errno.EPERM and text.endswith("needs CAP_NET_ADMIN"), text)


def mode_switches(rn: RdmaNetlink) -> None:
    check("mode-shared-at-boot", rn.netns_mode() == "shared" == rdma_sysfs.netns_mode()
          and "netns shared" in sh("rdma", "system", "show"))
    sh("ip", "netns", "add", "busy1")
    hidden = subprocess.Popen(["unshare", "-n", "sleep", "300"])
    try:
        # unshare(2) changes the namespace before exec(sleep): wait for both, or the kernel's
        # answer may name the process while it is still "unshare" (seen under emulation)
        waited = wait_for(lambda: os.stat(f"/proc/{hidden.pid}/ns/net").st_ino
                          != os.stat("/proc/1/ns/net").st_ino
                          and open(f"/proc/{hidden.pid}/comm").read().strip() == "sleep", 10)
        hidden_ino = os.stat(f"/proc/{hidden.pid}/ns/net").st_ino
        check("unnamed-netns-started", waited >= 0, f"net:[{hidden_ino}]")
        busy = refused("mode-exclusive-busy", lambda: rn.set_netns_mode("exclusive"), errno.EBUSY,
                       "busy1 (/var/run/netns/busy1)", RdmaBusy)
        check("mode-busy-names-unnamed-netns", busy is not None and f"net:[{hidden_ino}] (pid "
              f"{hidden.pid} sleep)" in str(busy), busy)
        check("mode-unchanged-after-busy", rn.netns_mode() == "shared")
    finally:
        hidden.kill()
        hidden.wait()
        sh("ip", "netns", "del", "busy1")
    took, busy_count = set_mode_when_free(rn, "exclusive")
    info("netns-teardown", f"SYS_SET exclusive succeeded {took:.1f}s after deleting the namespaces "
                           f"({busy_count} EBUSY answers while they were torn down)")
    check("mode-exclusive-set", rn.netns_mode() == "exclusive" == rdma_sysfs.netns_mode()
          and "netns exclusive" in sh("rdma", "system", "show"))


def exclusive_moves(rn: RdmaNetlink) -> None:
    """The recipe of real-rdma-kernel.md, with our client instead of `ip`/`rdma` for RDMA."""
    sh("ip", "link", "add", "v2", "type", "veth", "peer", "name", "v3")
    sh("ip", "link", "set", "v2", "up")
    sh("ip", "netns", "add", "pod1")
    sh("ip", "link", "set", "v3", "netns", "pod1")
    sh("ip", "-n", "pod1", "link", "set", "v3", "name", "rdma0")
    sh("ip", "-n", "pod1", "link", "set", "rdma0", "up")
    pod_fd = netns.open_netns("/var/run/netns/pod1")
    host_fd = netns.current_netns_fd()
    try:
        with netns.inside(pod_fd), RdmaNetlink() as pod:
            pod.link_add("rxe2", "rxe", "rdma0")
            check("pod-link-add-registers-in-init-net", pod.devices() == [], pod.devices())
        rxe2 = rn.device("rxe2")
        host_port = rn.ports("rxe2")[0]
        check("host-port-hides-pod-netdev", host_port.netdev_name is None, host_port)
        before = rn.chardev(rxe2.index)

        rn.move_device(rxe2.index, pod_fd)
        check("move-into-pod", "rxe2" not in {d.name for d in rn.devices()})
        refused("invisible-get", lambda: rn.device(rxe2.index), errno.EINVAL)
        refused("invisible-ports", lambda: rn.ports(rxe2.index), errno.EINVAL)
        refused("invisible-chardev", lambda: rn.chardev(rxe2.index), errno.EINVAL)
        refused("invisible-link-delete", lambda: rn.link_delete(rxe2.index), errno.EINVAL)
        refused("invisible-move", lambda: rn.move_device(rxe2.index, host_fd), errno.EINVAL,
                "device not visible in this namespace")
        with netns.inside(pod_fd), RdmaNetlink() as pod:
            seen = pod.devices()
            check("pod-sees-only-its-device", [d.name for d in seen] == ["rxe2"]
                  and seen[0].index == rxe2.index, seen)
            port = pod.ports(rxe2.index)[0]
            check("pod-port-netdev", port.netdev_name == "rdma0" and port.state_name == "ACTIVE", port)
            after = pod.chardev(rxe2.index)
            in_pod = sh("ip", "netns", "exec", "pod1", "cat",
                        f"/sys/class/infiniband_verbs/{after.name}/ibdev",
                        f"/sys/class/infiniband_verbs/{after.name}/dev").split()
            check("pod-chardev-matches-pod-sysfs", in_pod == ["rxe2", f"{after.major}:{after.minor}"], after)
            info("chardev-across-move", f"before {before}, after {after}")
            check("pod-mode-reads-exclusive", pod.netns_mode() == "exclusive")
            stray = RdmaNetlink()  # a socket in pod1, used below from a thread in the host
        refused("move-out-thread-in-host", lambda: stray.move_device(rxe2.index, host_fd),
                errno.ENODEV, "calling thread is not in the device's netns")
        stray.close()
        with netns.inside(pod_fd), RdmaNetlink() as pod:
            pod.move_device(rxe2.index, host_fd)
        check("move-out-of-pod", rn.device(rxe2.index).name == "rxe2")

        nldev_moves(rxe2.index, pod_fd, host_fd)

        refused("mode-shared-busy-with-pod", lambda: rn.set_netns_mode("shared"), errno.EBUSY,
                "pod1 (/var/run/netns/pod1)", RdmaBusy)
        rn.link_delete(rxe2.index)
        check("link-delete", "rxe2" not in {d.name for d in rn.devices()})
    finally:
        os.close(pod_fd)
        os.close(host_fd)
        sh("ip", "netns", "del", "pod1")


def nldev_moves(index: int, pod_fd: int, host_fd: int) -> None:
    """The CNI hot path's functions (device_index, move_device on a bare socket): the same moves."""
    with NetlinkSocket(rdma_nldev.NETLINK_RDMA) as host:
        rdma_nldev.move_device(host, index, pod_fd)
        check("nldev-move-into-pod", rdma_nldev.device_index(host, "rxe2") is None)
        refused("nldev-invisible-move", lambda: rdma_nldev.move_device(host, index, host_fd),
                errno.EINVAL, "device not visible in this namespace")
        with netns.inside(pod_fd):
            pod = NetlinkSocket(rdma_nldev.NETLINK_RDMA)
        with pod:
            check("nldev-pod-sees-device", rdma_nldev.device_index(pod, "rxe2") == index)
            refused("nldev-move-out-thread-in-host",
                    lambda: rdma_nldev.move_device(pod, index, host_fd), errno.ENODEV,
                    "calling thread is not in the device's netns")
        with netns.inside(pod_fd), NetlinkSocket(rdma_nldev.NETLINK_RDMA) as pod:
            rdma_nldev.move_device(pod, index, host_fd)
        check("nldev-move-out-of-pod", rdma_nldev.device_index(host, "rxe2") == index)


def cleanup(rn: RdmaNetlink, indexes: dict[str, int]) -> None:
    for index in indexes.values():
        rn.link_delete(index)
    check("all-links-deleted", rn.devices() == [] and rdma_json("dev") == [])
    took, busy_count = set_mode_when_free(rn, "shared")
    check("mode-shared-again", rn.netns_mode() == "shared",
          f"after {took:.1f}s and {busy_count} EBUSY answers")


def main() -> int:
    print(f"== kernel {os.uname().release}; importing the NETLINK_RDMA client (standard library) took "
          f"{IMPORT_SECONDS:.2f}s", flush=True)
    sh("ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    sh("ip", "link", "set", "v0", "up")
    sh("ip", "link", "set", "v1", "up")
    with RdmaNetlink() as rn:
        indexes: dict[str, int] = {}
        with phase("devices-ports"):
            indexes = devices_and_ports(rn)
        with phase("chardevs"):
            chardevs(rn, indexes["rxe0"], "rxe0")
        with phase("stdlib-lookups"):
            stdlib_lookups(indexes["rxe0"])
        with phase("shared-mode-refusals"):
            shared_mode_refusals(rn, indexes["rxe0"])
        with phase("without-cap-net-admin"):
            without_cap_net_admin(indexes["rxe0"])
        with phase("mode-switches"):
            mode_switches(rn)
        with phase("exclusive-moves"):
            exclusive_moves(rn)
        with phase("cleanup"):
            cleanup(rn, indexes)
    print(f"check-rdma-netlink: {len(PASSED)} passed, {len(FAILED)} failed"
          + (f" ({', '.join(FAILED)})" if FAILED else ""), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
