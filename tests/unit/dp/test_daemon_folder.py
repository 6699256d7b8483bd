"""The device-plugin daemon's folder (the grants broker's socket and the CNI events FIFO, by
default /run/rdma-netns): 0700 whatever made it (kubelet's hostPath DirectoryOrCreate makes it
0755), but a folder others share (sticky like /tmp, or writable by them) is refused, never made
private: the daemon must not take a folder away from whoever else uses it."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from rdma_netns.util import trusted_paths
from rdma_netns_dp import cni_events
from rdma_netns_dp.pod_grants import PodGrantsServer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="folder owners need root")


@pytest.fixture
def base():
    trusted_paths.forget()
    folder = Path(tempfile.mkdtemp(prefix="rndf-", dir="/tmp"))  # unix socket paths stay short
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
    trusted_paths.forget()


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def start_broker(folder: Path) -> PodGrantsServer:
    return PodGrantsServer(str(folder / "pod-grants.sock"), query=lambda *a, **k: None).start()


def start_receiver(folder: Path) -> cni_events.CniEventsReceiver:
    return cni_events.CniEventsReceiver(str(folder / "cni-events"), lambda *a: None, lambda: None).start()


@pytest.mark.parametrize("start", [start_broker, start_receiver], ids=["broker", "events"])
def test_a_folder_kubelet_made_0755_becomes_0700(base, start):
    folder = base / "run-rdma-netns"
    folder.mkdir()
    os.chmod(folder, 0o755)
    served = start(folder)
    try:
        assert mode_of(folder) == 0o700
    finally:
        served.stop()


@pytest.mark.parametrize("start", [start_broker, start_receiver], ids=["broker", "events"])
def test_a_missing_folder_is_made_0700(base, start):
    old = os.umask(0)
    try:
        served = start(base / "made" / "here")
    finally:
        os.umask(old)
    try:
        assert mode_of(base / "made" / "here") == 0o700
    finally:
        served.stop()


@pytest.mark.parametrize("start", [start_broker, start_receiver], ids=["broker", "events"])
@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o775])
def test_a_shared_folder_is_refused_and_left_as_it_is(base, start, mode):
    folder = base / "shared"
    folder.mkdir()
    os.chmod(folder, mode)
    with pytest.raises(PermissionError, match="sticky|writable"):
        start(folder)
    assert mode_of(folder) == mode and list(folder.iterdir()) == []
