#!/usr/bin/python3
"""Move a known buffer between two pod network namespaces over an RDMA RC QP.

Run one side in each pod (Debian's python3-pyverbs, hence /usr/bin/python3):

    rc_exchange.py server --addr fd00::11 [--port 18515] [--device rxe0]
    rc_exchange.py client --addr fd00::12 --peer fd00::11 [--port 18515]
    rc_exchange.py server --addr fd00::11 --oob-addr 10.99.0.1
    rc_exchange.py client --addr fd00::12 --peer fd00::11 --oob-addr 10.99.0.2 --oob-peer 10.99.0.1

Each side picks the RDMA device and the RoCE v2 GID whose content is its own
pod address (the index differs from layout to layout, so it is looked up by
content, in the first --gid-scan entries only: rxe has 1024 and reading them
all under emulation takes minutes). The sides swap QP number, PSN, GID, MTU and
the server's MR rkey/address over TCP, on the same IPv6 addresses or, as a job
does it, on other ones (--oob-addr/--oob-peer: the pod's eth0, IPv4), so that
no IP packet crosses the rail before the QP resolves its peer; the client
then RDMA WRITEs one pattern into the server's memory and SENDs a second one
into a posted receive. RC ordering guarantees the WRITE is placed before the
SEND completes, so the server checks both byte for byte once the receive
completes and tells the client its verdict over TCP.

Each side prints one JSON line (ok, device, gid_index, bytes, timings, error)
and exits 0 only when the server verified every byte. Every wait is bounded by
--timeout. Exit codes: 0 verified, 1 transfer failed or data differed,
2 usage, 3 setup (no address, device or GID; pyverbs missing), 124 timeout.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import ipaddress
import json
import random
import select
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAIL, EXIT_SETUP, EXIT_TIMEOUT = 0, 1, 3, 124
T_START = time.monotonic()  # before the pyverbs import: it alone takes seconds under TCG

try:
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ, cqe_status_to_str
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR
except ImportError as err:  # wrong interpreter: pyverbs is built for Debian's python3 only
    print(json.dumps({"tool": "rc_exchange", "ok": False,
                      "error": f"pyverbs not importable ({err}); run with /usr/bin/python3"}))
    sys.exit(EXIT_SETUP)

T_IMPORTED = time.monotonic()


class Failure(Exception):
    """An error that ends the run with a given exit code and a clear message."""

    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


SYSFS_IB = Path("/sys/class/infiniband")
ROCE_V2 = "RoCE v2"
IFA_F_DADFAILED = 0x08
IFA_F_TENTATIVE = 0x40
HOP_LIMIT = 64
# 4.096 us * 2^18 ~ 1 s per ACK timeout: a TCG guest can stall for longer
# than the usual 67 ms (timeout 14) and would then burn its retries.
ACK_TIMEOUT = 18
# 6, not 7: 7 means "retry forever" (rxe applies that to retry_cnt as well as
# to rnr_retry), which turns a broken path into a timeout instead of a
# "transport retry counter exceeded" completion after ~7 s.
RETRIES = 6
MIN_RNR_TIMER = 12
POLL_SLEEP_S = 0.002


@dataclass(frozen=True)
class Deadline:
    """One budget for the whole run, so that no single wait can hang it."""

    end: float

    def left(self, what: str) -> float:
        """Seconds left; raise a timeout Failure naming `what` when none are."""
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise Failure(f"timed out while {what}", EXIT_TIMEOUT)
        return remaining


@dataclass(frozen=True)
class GidChoice:
    """Where the pod's address lives in the RDMA GID tables."""

    device: str
    port: int
    index: int
    ndev: str       # netdev the GID entry belongs to
    port_ndev: str  # netdev of the port itself (its default GID, entry 0)


def read_attr(path: Path) -> str | None:
    """A sysfs attribute, or None: unset GID entries fail to read (EINVAL)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def address_state(addr: ipaddress.IPv6Address) -> tuple[str, int] | None:
    """(interface, IFA flags) of `addr` in this netns, from /proc/net/if_inet6.

    /proc/net follows the caller's netns, so this answers for the pod.
    """
    for line in Path("/proc/net/if_inet6").read_text().splitlines():
        hexaddr, _ifindex, _plen, _scope, flags, ifname = line.split()
        if ipaddress.IPv6Address(bytes.fromhex(hexaddr)) == addr:
            return ifname, int(flags, 16)
    return None


def wait_address_usable(addr: ipaddress.IPv6Address, deadline: Deadline) -> str:
    """Interface holding `addr` once DAD is over: a tentative address cannot be bound."""
    while True:
        state = address_state(addr)
        if state is None:
            raise Failure(f"{addr} is not configured in this network namespace", EXIT_SETUP)
        ifname, flags = state
        if flags & IFA_F_DADFAILED:
            raise Failure(f"{addr} on {ifname} failed duplicate address detection", EXIT_SETUP)
        if not flags & IFA_F_TENTATIVE:
            return ifname
        deadline.left(f"waiting for DAD of {addr} on {ifname}")
        time.sleep(0.1)


def visible_devices(wanted: str | None) -> list[str]:
    """RDMA devices this netns sees (sysfs follows the netns under `ip netns exec`)."""
    names = sorted(p.name for p in SYSFS_IB.iterdir()) if SYSFS_IB.is_dir() else []
    if wanted is not None:
        if wanted not in names:
            raise Failure(f"RDMA device {wanted} not visible here (visible: {names or 'none'})",
                          EXIT_SETUP)
        return [wanted]
    if not names:
        raise Failure("no RDMA device visible in this network namespace", EXIT_SETUP)
    return names


def gid_matches(device: str, addr: ipaddress.IPv6Address, scan: int) -> list[GidChoice]:
    """RoCE v2 entries of `device` among the first `scan` of each port that hold `addr`."""
    found = []
    for port_dir in sorted((SYSFS_IB / device / "ports").iterdir(), key=lambda p: int(p.name)):
        port_ndev = read_attr(port_dir / "gid_attrs" / "ndevs" / "0") or ""
        for index in range(scan):
            gid = read_attr(port_dir / "gids" / str(index))
            if gid is None or ipaddress.IPv6Address(gid) != addr:
                continue
            if read_attr(port_dir / "gid_attrs" / "types" / str(index)) != ROCE_V2:
                continue
            ndev = read_attr(port_dir / "gid_attrs" / "ndevs" / str(index)) or ""
            found.append(GidChoice(device, int(port_dir.name), index, ndev, port_ndev))
    return found


def pick_gid(addr: ipaddress.IPv6Address, ifname: str, device: str | None,
             scan: int) -> tuple[GidChoice, list[GidChoice]]:
    """The best GID for `addr`, and every candidate (reported for diagnosis).

    Several devices can carry the address: a device on the lower netdev lists
    its upper devices' addresses too (shared mode). Prefer an entry whose ndev
    is the pod interface, then a device whose own port netdev is that
    interface: Soft-RoCE only receives on the netdev it was created on.
    """
    devices = visible_devices(device)
    candidates = [c for d in devices for c in gid_matches(d, addr, scan)]
    if not candidates:
        raise Failure(f"no RoCE v2 GID equal to {addr} in the first {scan} entries of "
                      f"{devices}", EXIT_SETUP)
    best = min(candidates, key=lambda c: (c.ndev != ifname, c.port_ndev != ifname,
                                          c.device, c.port, c.index))
    return best, candidates


def pattern(seed: int, label: str, size: int) -> bytes:
    """Deterministic, non-repeating bytes both sides can compute from the seed."""
    return hashlib.shake_256(f"rc_exchange:{seed}:{label}".encode()).digest(size)


def first_difference(got: bytes, want: bytes) -> int | None:
    """Offset of the first differing byte, None when equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


class Endpoint:
    """PD, CQs, one MR of two halves and an RC QP on the chosen GID's port.

    Half 0 is the RDMA WRITE buffer, half 1 the SEND/RECV buffer.
    """

    def __init__(self, choice: GidChoice, size: int, remote_access: bool) -> None:
        self.choice = choice
        self.size = size
        self.ctx = Context(name=choice.device)
        self.mtu = int(self.ctx.query_port(choice.port).active_mtu)
        self.pd = PD(self.ctx)
        self.send_cq = CQ(self.ctx, 4)
        self.recv_cq = CQ(self.ctx, 4)
        access = e.IBV_ACCESS_LOCAL_WRITE
        if remote_access:
            access |= e.IBV_ACCESS_REMOTE_WRITE
        self.mr = MR(self.pd, 2 * size, access)
        init_attr = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq,
                               cap=QPCap(max_send_wr=4, max_recv_wr=4,
                                         max_send_sge=1, max_recv_sge=1))
        qp_attr = QPAttr(port_num=choice.port)
        qp_attr.qp_access_flags = access
        self.qp = QP(self.pd, init_attr, qp_attr)  # left in INIT: receives can be posted
        self.psn = random.getrandbits(24)

    def local_info(self) -> dict[str, Any]:
        """What the peer needs to reach this QP and (server) write into this MR."""
        return {"qpn": self.qp.qp_num, "psn": self.psn, "mtu": self.mtu,
                "gid": str(ipaddress.IPv6Address(self.ctx.query_gid(
                    self.choice.port, self.choice.index).gid)),
                "rkey": self.mr.rkey, "addr": self.mr.buf, "size": self.size}

    def connect(self, peer: dict[str, Any]) -> int:
        """INIT -> RTR -> RTS towards the peer's QP; returns the path MTU in bytes."""
        attr = QPAttr(port_num=self.choice.port)
        attr.path_mtu = min(self.mtu, int(peer["mtu"]))
        attr.dest_qp_num = int(peer["qpn"])
        attr.rq_psn = int(peer["psn"])
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = MIN_RNR_TIMER
        route = GlobalRoute(dgid=GID(ipaddress.IPv6Address(peer["gid"]).exploded),
                            sgid_index=self.choice.index, hop_limit=HOP_LIMIT)
        attr.ah_attr = AHAttr(port_num=self.choice.port, is_global=1, gr=route)
        attr.sq_psn = self.psn
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRIES
        attr.rnr_retry = RETRIES
        attr.max_rd_atomic = 1
        self.qp.to_rts(attr)
        return 128 << attr.path_mtu  # enum ibv_mtu: 1 = 256 ... 5 = 4096

    def post_recv(self) -> None:
        """Receive the SEND into half 1 (posted before the peer learns our QPN)."""
        sge = SGE(self.mr.buf + self.size, self.size, self.mr.lkey)
        self.qp.post_recv(RecvWR(wr_id=2, num_sge=1, sg=[sge]))

    def post_write_and_send(self, rkey: int, remote_addr: int) -> None:
        """RDMA WRITE half 0 to the peer's half 0, then SEND half 1."""
        write = SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                       sg=[SGE(self.mr.buf, self.size, self.mr.lkey)],
                       send_flags=e.IBV_SEND_SIGNALED)
        write.set_wr_rdma(rkey, remote_addr)
        send = SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1,
                      sg=[SGE(self.mr.buf + self.size, self.size, self.mr.lkey)],
                      send_flags=e.IBV_SEND_SIGNALED)
        self.qp.post_send(write)
        self.qp.post_send(send)

    def half(self, which: int) -> bytes:
        """Contents of half `which` of the MR."""
        return self.mr.read(self.size, which * self.size)

    def fill(self, seed: int) -> None:
        """Put the WRITE and SEND patterns into the two halves."""
        self.mr.write(pattern(seed, "write", self.size), self.size, 0)
        self.mr.write(pattern(seed, "send", self.size), self.size, self.size)


def peer_closed(sock: socket.socket) -> bool:
    """True when the peer hung up: a failed client should not leave the server
    polling its CQ until the deadline."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""


def wait_completions(cq: CQ, count: int, deadline: Deadline, what: str,
                     peer: socket.socket) -> list[Any]:
    """Poll `count` successful completions, sleeping briefly (TCG has few CPUs)."""
    done: list[Any] = []
    while len(done) < count:
        npolled, wcs = cq.poll(1)
        if npolled == 0:
            deadline.left(f"waiting for {what} ({len(done)}/{count} completions)")
            if peer_closed(peer):
                raise Failure(f"peer closed the TCP connection while waiting for {what} "
                              "(see its own report)")
            time.sleep(POLL_SLEEP_S)
            continue
        wc = wcs[0]
        if wc.status != e.IBV_WC_SUCCESS:
            raise Failure(f"{what}: work request {wc.wr_id} completed with "
                          f"'{cqe_status_to_str(wc.status)}' (status {wc.status}, "
                          f"vendor_err {wc.vendor_err})")
        done.append(wc)
    return done


def send_json(sock: socket.socket, message: dict[str, Any]) -> None:
    """One JSON object per line on the TCP side channel."""
    sock.sendall(json.dumps(message).encode() + b"\n")


def recv_json(sock: socket.socket, deadline: Deadline, what: str) -> dict[str, Any]:
    """Read one JSON line, bounded by the deadline."""
    data = b""
    while not data.endswith(b"\n"):
        sock.settimeout(deadline.left(f"waiting for {what} from the peer"))
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            continue  # the next left() call raises the timeout
        if not chunk:
            raise Failure(f"peer closed the TCP connection before sending {what}")
        data += chunk
    return json.loads(data)


def family_of(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET


def accept_peer(addr: str, port: int, deadline: Deadline) -> socket.socket:
    """Listen on the side-channel address and take one client."""
    with socket.create_server((addr, port), family=family_of(addr)) as server:
        while True:
            server.settimeout(deadline.left(f"waiting for a client on [{addr}]:{port}"))
            try:
                conn, _ = server.accept()
                return conn
            except socket.timeout:
                continue


def connect_peer(addr: str, peer: str, port: int, deadline: Deadline) -> socket.socket:
    """Connect from the pod address, retrying while the server is still starting
    (refused) or the neighbour is not resolved yet (unreachable)."""
    while True:
        remaining = deadline.left(f"connecting to [{peer}]:{port}")
        try:
            return socket.create_connection((peer, port), timeout=min(remaining, 10),
                                            source_address=(addr, 0))
        except (ConnectionRefusedError, socket.timeout):
            pass
        except OSError as err:
            if err.errno != errno.EHOSTUNREACH:
                raise
        time.sleep(min(0.5, remaining))


def run_server(args: argparse.Namespace, ep: Endpoint, deadline: Deadline) -> dict[str, Any]:
    """Receive the WRITE and the SEND, verify both, tell the client."""
    ep.post_recv()
    with accept_peer(args.oob_addr or args.addr, args.port, deadline) as conn:
        client = recv_json(conn, deadline, "its QP data")
        if int(client["size"]) != ep.size:
            raise Failure(f"client sends {client['size']} bytes, server expects {ep.size} "
                          "(use the same --size on both sides)", EXIT_SETUP)
        path_mtu = ep.connect(client)  # RTR before the client can learn our QPN
        send_json(conn, ep.local_info())
        t0 = time.monotonic()
        wc = wait_completions(ep.recv_cq, 1, deadline, "the client's SEND", conn)[0]
        transfer_s = time.monotonic() - t0
        seed = int(client["seed"])
        write_diff = first_difference(ep.half(0), pattern(seed, "write", ep.size))
        send_diff = first_difference(ep.half(1), pattern(seed, "send", ep.size))
        verdict = {"ok": write_diff is None and send_diff is None and wc.byte_len == ep.size,
                   "write_first_diff": write_diff, "send_first_diff": send_diff,
                   "recv_byte_len": wc.byte_len}
        send_json(conn, verdict)
    return {**verdict, "peer": str(client["gid"]), "path_mtu": path_mtu,
            "transfer_s": round(transfer_s, 4)}


def run_client(args: argparse.Namespace, ep: Endpoint, deadline: Deadline) -> dict[str, Any]:
    """WRITE then SEND the patterns, and report the server's verdict."""
    seed = args.seed if args.seed is not None else random.getrandbits(32)
    ep.fill(seed)
    with connect_peer(args.oob_addr or args.addr, args.oob_peer or args.peer, args.port, deadline) as conn:
        send_json(conn, {**ep.local_info(), "seed": seed})
        server = recv_json(conn, deadline, "its QP data")
        path_mtu = ep.connect(server)
        t0 = time.monotonic()
        ep.post_write_and_send(int(server["rkey"]), int(server["addr"]))
        wait_completions(ep.send_cq, 2, deadline, "the WRITE and SEND completions", conn)
        transfer_s = time.monotonic() - t0
        verdict = recv_json(conn, deadline, "the verdict")
    return {**verdict, "peer": str(server["gid"]), "path_mtu": path_mtu, "seed": seed,
            "transfer_s": round(transfer_s, 4)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command line; the role decides which addresses are required."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("server", "client"))
    parser.add_argument("--addr", required=True, help="this pod's IPv6 address (its GID)")
    parser.add_argument("--peer", help="server's IPv6 address (client only)")
    parser.add_argument("--port", type=int, default=18515, help="TCP port of the side channel")
    parser.add_argument("--oob-addr", help="this pod's side-channel address (default --addr)")
    parser.add_argument("--oob-peer", help="server's side-channel address (client; default --peer)")
    parser.add_argument("--device", help="RDMA device (default: search the visible ones)")
    parser.add_argument("--size", type=int, default=64 * 1024, help="bytes per WRITE and SEND")
    parser.add_argument("--seed", type=int, help="pattern seed (client; default random)")
    parser.add_argument("--gid-scan", type=int, default=8, help="GID entries read per port")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    if args.role == "client" and not args.peer:
        parser.error("client needs --peer")
    if args.size <= 0 or args.gid_scan <= 0:
        parser.error("--size and --gid-scan must be positive")
    return args


def run(args: argparse.Namespace, report: dict[str, Any]) -> bool:
    """Set up, move the data, fill `report`; True when the server verified it."""
    deadline = Deadline(T_START + args.timeout)
    addr = ipaddress.IPv6Address(args.addr)
    ifname = wait_address_usable(addr, deadline)
    choice, candidates = pick_gid(addr, ifname, args.device, args.gid_scan)
    report.update(device=choice.device, port=choice.port, gid_index=choice.index,
                  ndev=choice.ndev, netdev=ifname,
                  candidates=[f"{c.device}/{c.port}/{c.index}" for c in candidates])
    ep = Endpoint(choice, args.size, remote_access=args.role == "server")
    report["setup_s"] = round(time.monotonic() - T_IMPORTED, 3)
    result = (run_server if args.role == "server" else run_client)(args, ep, deadline)
    report.update(result)
    if result["ok"]:
        report["bytes"] = 2 * args.size
    return bool(result["ok"])


def main(argv: list[str]) -> int:
    """Run one side and print its JSON report line."""
    args = parse_args(argv)
    report: dict[str, Any] = {"tool": "rc_exchange", "role": args.role, "ok": False,
                              "addr": args.addr, "bytes": 0,
                              "import_s": round(T_IMPORTED - T_START, 3)}
    code = EXIT_FAIL
    try:
        code = EXIT_OK if run(args, report) else EXIT_FAIL
        if code != EXIT_OK:
            report["error"] = "received data differs from the expected pattern"
    except Failure as err:
        report["error"], code = str(err), err.code
    except (PyverbsError, OSError, ValueError, KeyError) as err:
        report["error"] = f"{type(err).__name__}: {err}"
    report["ok"] = code == EXIT_OK
    report["elapsed_s"] = round(time.monotonic() - T_START, 3)
    print(json.dumps(report), flush=True)
    if code != EXIT_OK:
        print(f"rc_exchange {args.role}: FAILED: {report['error']}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
