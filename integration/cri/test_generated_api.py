"""The committed CRI client code is exactly what gen-proto.sh makes from the committed .proto, and
the .proto still carries the wire facts the suite relies on (kubelet's field numbers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from integration.cri.api.runtime.v1 import api_pb2 as cri

HERE = Path(__file__).resolve().parent
GENERATED = ["api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"]


def test_generated_code_matches_the_proto(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run([str(HERE / "gen-proto.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fresh = tmp_path / "integration/cri/api/runtime/v1"
    for name in GENERATED:
        assert (fresh / name).read_bytes() == (HERE / "api/runtime/v1" / name).read_bytes(), \
            f"{name} drifted from api.proto: run integration/cri/gen-proto.sh"


def test_proto_has_no_gogoproto_and_kubelet_field_numbers():
    text = (HERE / "api/runtime/v1/api.proto").read_text()
    assert "gogo.proto" not in text and "(gogoproto." not in text
    fields = lambda message: {f.name: f.number for f in message.DESCRIPTOR.fields}  # noqa: E731
    assert cri.DESCRIPTOR.package == "runtime.v1"
    assert fields(cri.PodSandboxMetadata) == {"name": 1, "uid": 2, "namespace": 3, "attempt": 4}
    assert {k: v for k, v in fields(cri.PodSandboxConfig).items() if k in ("metadata", "hostname", "linux")} == \
        {"metadata": 1, "hostname": 2, "linux": 8}
    assert fields(cri.NamespaceOption)["network"] == 1 and cri.NamespaceMode.Value("POD") == 0
    assert fields(cri.PodSandboxNetworkStatus) == {"ip": 1, "additional_ips": 2}
    assert fields(cri.PodSandboxStatusResponse) == {"status": 1, "info": 2}
    service = cri.DESCRIPTOR.services_by_name["RuntimeService"]
    assert {"Version", "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "PodSandboxStatus",
            "ListPodSandbox", "Status"} <= set(service.methods_by_name)
