"""The CNI trusts a grants broker's answer only from root (SO_PEERCRED), issue 36 item 5.

podGrantsSocket is a config key: a config author who is not root's equal could name a socket of
their own and answer "granted" for every pod. The broker the plugin means is rdma-netns-dp, root's;
a socket served by anybody else gets no question and its answer is never read: ADD fails with 107
naming the socket and its owner's uid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.netns.test_pairing import k8s_args, primary_result

pytestmark = pytest.mark.netns

FAKE_BROKER = r"""
import json, os, socket, sys
path, record = sys.argv[1], sys.argv[2]
os.setgid(65534)
os.setuid(65534)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(8)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    conn.settimeout(5)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        with open(record, "ab") as f:
            f.write(data or b"(nothing)\n")
        if data:
            conn.sendall(json.dumps({"found": True, "deviceIDs": ["hca-0001"], "via": "get"}).encode() + b"\n")
    except OSError:
        pass
    conn.close()
"""


@pytest.fixture
def foreign_broker():
    folder = Path(tempfile.mkdtemp(prefix="rnfb-", dir="/tmp"))
    os.chmod(folder, 0o777)  # nobody binds its socket here
    record = folder / "questions"
    record.touch()
    os.chmod(record, 0o666)
    proc = subprocess.Popen([sys.executable, "-c", FAKE_BROKER, str(folder / "grants.sock"), str(record)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield folder / "grants.sock", record
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_broker_not_served_by_root_is_not_asked_and_not_believed(node, foreign_broker):
    sock, record = foreign_broker
    assert os.stat(sock).st_uid == 65534
    pod = node.pod()
    conf = node.conf(rails=2, version="1.0.0", resourceName="rdma/hca", podGrantsSocket=str(sock),
                     podResourcesSocket=str(sock.parent / "no-kubelet.sock"), podResourcesTimeoutMs=2000,
                     prevResult=primary_result(node, pod))
    err = node.cni("ADD", conf, pod, ifname="eth0", extra_env=k8s_args("trainer")).error(107)
    assert str(sock) in err["msg"] and "uid 65534" in err["msg"], err
    assert set(node.links(pod)) == {"lo"}, "nothing attached on a foreign broker's word"
    questions = record.read_text().splitlines()
    assert all(q == "(nothing)" for q in questions), f"the pod's identity went to a foreign broker: {questions}"
