"""Fixtures: the real rdma-netns-dp daemon as a subprocess, a fake sysfs host and a stand-in kubelet."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fake_rdma_sysfs import ZERO_GID, FakeRdmaSysfs, standard_host
from tests.kubelet_standin import KubeletStandIn, PluginConnection, wait_for_path

REPO = Path(__file__).resolve().parent.parent.parent
DP_BIN = os.environ.get("RDMA_NETNS_DP_BIN", str(REPO / ".venv/bin/rdma-netns-dp"))
INTERVAL = 0.2
RESOURCE = "rdma/hca"
SLUG = "rdma_hca"
SOCKET = f"rdma-netns-{SLUG}.sock"
START_TIMEOUT = 10.0
# The exclusive IDs of the standard host (fake_rdma_sysfs.standard_host).
EXCLUSIVE_IDS = {"0000:1a:00.0", "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0",
                 "0000:b1:00.0", "0000:d8:00.0", "0000:d9:00.0", "rxe0"}


def dp_binary() -> str:
    if not os.access(DP_BIN, os.X_OK):
        pytest.fail(f"{DP_BIN} is not installed (pip install the repo into .venv)")
    return DP_BIN


class Daemon:
    """One rdma-netns-dp process; its output goes to files under the host's folder."""

    def __init__(self, args: list[str], log_dir: Path, name: str = "dp") -> None:
        self.args = [dp_binary(), *args]
        self.out_path = log_dir / f"{name}.stdout"
        self.err_path = log_dir / f"{name}.stderr"
        self._out = open(self.out_path, "wb")
        self._err = open(self.err_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        self._out.flush()
        self._err.flush()
        return (f"--- command: {' '.join(self.args)}\n--- stdout:\n{self.out_path.read_text(errors='replace')}"
                f"\n--- stderr:\n{self.err_path.read_text(errors='replace')[-6000:]}")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"daemon ignored signal {sig} for {timeout} s\n{self.output()}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._out.close()
        self._err.close()


# Twice Soft-RoCE's 1024: with two addresses per pod (the device plugin's default addressesPerPod:
# the pod's own and its rail's link-local one) the GID cap then stays above the default 1000 units,
# so the tests of other things see every unit Healthy.
HOST_GID_TABLE = 2048


def soft_roce_gid_tables(fake: FakeRdmaSysfs, size: int = 1024) -> FakeRdmaSysfs:
    """Give every RoCE port a whole, mostly empty GID table of `size` entries (Soft-RoCE's by
    default), as the kernel lists it (fake_rdma_sysfs writes entry 0 alone, which reads as a full
    one-entry table), so that the shared units' GID cap is the table's. The empty entries are
    hard links to one file (7000 files per host otherwise); the fake replaces a file to change
    it, never writes into one, so they stay independent."""
    empty = fake.root / "empty-gid"
    empty.write_text(ZERO_GID + "\n")
    for dev in fake.devices.values():
        for port in (dev.folder / "ports").iterdir():
            if (port / "link_layer").read_text().strip() != "Ethernet":
                continue
            for index in range(len(list((port / "gids").iterdir())), size):
                os.link(empty, port / f"gids/{index}")
    return fake


FakeBuilder = Callable[[Path, "str | None"], FakeRdmaSysfs]


class Host:
    """A temporary node: fake sysfs + /dev, a kubelet dir with a stand-in kubelet, daemons.
    `build` makes the fake tree (root, netns_mode): the standard host by default."""

    def __init__(self, netns_mode: str | None = "Y", *, soft: bool = True, kubelet: bool = True,
                 build: FakeBuilder | None = None) -> None:
        # Short paths: unix socket paths are limited to 107 bytes.
        self.base = Path(tempfile.mkdtemp(prefix="rdp-", dir="/tmp"))
        if build is None:
            self.fake: FakeRdmaSysfs = soft_roce_gid_tables(standard_host(self.base / "host", netns_mode, soft=soft),
                                                            HOST_GID_TABLE)
        else:
            self.fake = build(self.base / "host", netns_mode)
        self.kubelet_dir = self.base / "k"
        self.plugins_dir = self.kubelet_dir / "device-plugins"
        self.plugins_dir.mkdir(parents=True)
        self.health_file = self.base / "health.json"
        self.cdi_dir = self.base / "cdi"
        self.kubelet = KubeletStandIn(self.plugins_dir)
        if kubelet:
            self.kubelet.start()
        self.daemons: list[Daemon] = []

    @property
    def dev_root(self) -> str:
        return str(self.fake.dev)

    def socket(self, slug: str = SLUG) -> Path:
        return self.plugins_dir / f"rdma-netns-{slug}.sock"

    def base_args(self) -> list[str]:
        return ["--kubelet-dir", str(self.kubelet_dir), "--sysfs-root", str(self.fake.sys),
                "--dev-root", self.dev_root, "--health-interval", str(INTERVAL),
                "--health-file", str(self.health_file),
                # Never the node's default grants socket: test daemons are killed, not stopped.
                "--pod-grants-socket", str(self.base / "pg.sock")]

    def write_config(self, content: dict | str, name: str = "config.yaml") -> Path:
        path = self.base / name
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return path

    def start(self, *extra: str, config: dict | str | None = None, base: bool = True) -> Daemon:
        """Start the daemon (serve) with the base flags plus `extra` (and --config when given)."""
        args = self.base_args() if base else []
        if config is not None:
            args += ["--config", str(self.write_config(config, "config.json" if isinstance(config, dict)
                                                       else "config.yaml"))]
        daemon = Daemon([*args, *extra], self.base, f"dp{len(self.daemons)}")
        self.daemons.append(daemon)
        return daemon

    def start_registered(self, *extra: str, config: dict | str | None = None, resource: str = RESOURCE,
                         count: int = 1) -> tuple[Daemon, PluginConnection]:
        """Start the daemon and wait for its Register (count-th overall) and a first device list."""
        daemon = self.start(*extra, config=config)
        try:
            self.kubelet.wait_registrations(count, START_TIMEOUT)
            plugin = self.kubelet.plugin(resource, START_TIMEOUT)
            plugin.wait_first(START_TIMEOUT)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nalive={daemon.alive()}\n{daemon.output()}") from None
        return daemon, plugin

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.close()
        self.kubelet.close()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def host() -> Iterator[Host]:
    """A shared-mode (netns_mode Y) standard host with a running stand-in kubelet."""
    h = Host("Y")
    yield h
    h.close()


# Package scope: the daemons poll their fake trees every 0.2 s (about a quarter of a core for the
# shared one); with session scope they kept polling through every later suite of the test command.
@pytest.fixture(scope="package")
def shared_dp() -> Iterator[tuple[Host, Daemon, PluginConnection]]:
    """One daemon in shared mode for read-only tests (never mutate its host)."""
    h = Host("Y")
    daemon, plugin = h.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    yield h, daemon, plugin
    h.close()


@pytest.fixture(scope="package")
def exclusive_dp() -> Iterator[tuple[Host, Daemon, PluginConnection]]:
    """One daemon in exclusive mode for read-only tests (never mutate its host)."""
    h = Host("N")
    daemon, plugin = h.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    yield h, daemon, plugin
    h.close()


__all__ = ["Daemon", "EXCLUSIVE_IDS", "Host", "INTERVAL", "RESOURCE", "SLUG", "SOCKET", "wait_for_path"]
