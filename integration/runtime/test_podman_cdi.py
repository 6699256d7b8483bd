"""Issue 17 with a real runtime: Podman 4.3 consumes the CDI spec the CNI wrote at ADD.

The CNI runs as in tests/netns/test_pod_info.py (a private node namespace whose veth rails are
RoCE ports of fake soft devices, static addresses with pre-written GID entries, requireRdma true,
paired with the kubelet stand-in) and writes the pod's JSON file and the CDI spec of its granted
unit into /var/run/cdi, the folder Podman 4.3 reads (not configurable in 4.3). Then
`podman run --network ns:<the pod's netns> --device <kind>=<unit>` starts a container in the
pod's namespace: it must show the env, the mounted JSON file and the char devices (mknod'ed
stand-ins with /dev/null's numbers, since this machine has no RDMA hardware).
The kind is unique per run (rdma-netns-test-<tag>.io/pod) so nothing else in /var/run/cdi can
collide; the spec is removed by DEL (asserted) and by the finalizer after a failure.

containerd 1.6 (the CRI test's runtime) has no CDI support, so it is not tested here.
"""

from __future__ import annotations

import json
import os
import stat
import uuid

import pytest

from integration.runtime.conftest import PODMAN_REPORT
from integration.runtime.podman_rig import IMAGE, PodmanRig
from integration.runtime.test_podman import _podman_ready
from tests.conftest import installed_executable
from tests.netns.conftest import node  # noqa: F401 (fixture)
from tests.netns.test_pairing import RESOURCE, k8s_args, kubelet, paired, short_tmp  # noqa: F401 (fixtures)
from tests.netns.test_pod_info import Rig

pytestmark = pytest.mark.netns

CDI_DIR = "/var/run/cdi"
SHOW = ("env | grep -E '^(NCCL|UCX|RDMA_NETNS)_' | sort; echo ---; cat /etc/rdma-netns/rails.json; echo ---; "
        "ls -l /dev/infiniband; echo ---; ip -6 -o addr show scope global; echo ---; cat /etc/nccl.conf")
# A Lingjun job's own settings in the pod spec (Alibaba PAI's advice): the fabric's QoS, and an HCA
# filter of its own. They must reach the process as the pod spec says.
POD_SPEC_ENV = {"NCCL_IB_TC": "136", "NCCL_IB_SL": "5", "NCCL_IB_HCA": "mlx5"}


def nccl_view(env: dict[str, str], conf_text: str) -> dict[str, str]:
    """The settings NCCL ends up with: its initEnv() applies /etc/nccl.conf line by line with
    setenv(name, value, 0) (src/misc/param.cc), so a variable already in the environment stays."""
    out = dict(env)
    for line in conf_text.splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        name, value = line.split("=", 1)
        out.setdefault(name, value)
    return out


@pytest.fixture(scope="module")
def podman():
    why = _podman_ready()
    if why:
        pytest.skip(why)
    r = PodmanRig(installed_executable(), rails=0)
    try:
        r.import_image()
        smoke = r.podman("run", "--rm", "--network", "none", IMAGE, "true", check=False)
        if smoke.returncode != 0:
            pytest.skip(f"podman cannot run a container here: {smoke.stderr.strip()}")
        yield r
    finally:
        r.close()


def char_devices(folder, names: list[str]) -> None:
    """Real char device nodes for the spec's hostPaths (1:3 = /dev/null's numbers)."""
    (folder / "infiniband").mkdir(parents=True)
    for name in names:
        os.mknod(folder / "infiniband" / name, 0o666 | stat.S_IFCHR, os.makedev(1, 3))


def test_podman_run_with_the_pods_cdi_device_sees_env_json_and_devices(podman, node, kubelet, tmp_path):
    tag = uuid.uuid4().hex[:6]
    kind, unit = f"rdma-netns-test-{tag}.io/pod", f"hca-{tag}"
    spec_path = f"{CDI_DIR}/rdma-netns-pod-{unit}.json"
    rig = Rig(node, tmp_path)
    rig.gid("rxe0", 3, "fd00:1::5", "rdma0")
    rig.gid("rxe1", 3, "fd00:2::5", "rdma1")
    dev = tmp_path / "dev"
    uverbs = [f"uverbs{rig.fake.uverbs_number(d)}" for d in ("rxe0", "rxe1")]
    char_devices(dev, uverbs + ["rdma_cm"])
    rig.env["RDMA_NETNS_DEV_ROOT"] = str(dev)
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: [unit]}})
    base = paired(node, kubelet, rails=2)
    conf = rig.conf(["fd00:1::5/64", "fd00:2::5/64"], cdiSpecDir=CDI_DIR, cdiKind=kind,
                    **{k: base[k] for k in ("resourceName", "podResourcesSocket", "podGrantsSocket",
                                            "podResourcesTimeoutMs")})
    pod = node.pod()
    try:
        rig.cni("ADD", conf, pod, extra_env=k8s_args("trainer")).ok()
        record = json.loads(rig.info("c1").read_text())
        pod_spec = [arg for k, v in POD_SPEC_ENV.items() for arg in ("-e", f"{k}={v}")]
        proc = podman.podman("run", "--rm", "--network", f"ns:{node.netns_path(pod)}", "--device", f"{kind}={unit}",
                             *pod_spec, IMAGE, "sh", "-c", SHOW, check=False)
        assert proc.returncode == 0, f"podman refused the CNI's CDI spec: {proc.stderr}"
        env_text, json_text, devices, addresses, nccl_text = proc.stdout.split("---\n")
        seen = dict(line.split("=", 1) for line in env_text.splitlines())
        published = {k: v for k, v in record["env"].items() if not k.startswith("NCCL_")}
        assert seen == published | POD_SPEC_ENV, "the env edits carry no NCCL_*: the pod spec's reach the process"
        nccl = nccl_view(seen, nccl_text)
        assert nccl["NCCL_IB_GID_INDEX"] == "3" and nccl["NCCL_SOCKET_IFNAME"] == "=rdma0,rdma1"
        assert nccl["NCCL_IB_HCA"] == "mlx5", "the pod spec's value wins over the published one"
        assert (nccl["NCCL_IB_TC"], nccl["NCCL_IB_SL"]) == ("136", "5"), "the fabric's QoS untouched"
        assert not any(k in nccl_text for k in ("NCCL_IB_TC", "NCCL_IB_SL", "NCCL_IB_TIMEOUT"))
        assert json.loads(json_text) == record, "the mounted file is the pod's record"
        for name in uverbs + ["rdma_cm"]:
            line = next(ln for ln in devices.splitlines() if ln.endswith(f" {name}"))
            assert line.startswith("c"), f"{name} is not a char device in the container: {line}"
        assert "rdma0" in addresses and "fd00:1::5/64" in addresses and "fd00:2::5/64" in addresses
        PODMAN_REPORT.append(f"podman run --device {kind}={unit} (CDI spec written by the CNI's ADD) shows:")
        PODMAN_REPORT.extend(f"  {line}" for line in proc.stdout.splitlines())
        ro = podman.podman("run", "--rm", "--device", f"{kind}={unit}", "--network", "none", IMAGE,
                           "sh", "-c", "echo x > /etc/rdma-netns/rails.json", check=False)
        assert ro.returncode != 0 and "Read-only" in ro.stderr, "the file is mounted read-only"

        rig.cni("DEL", conf, pod).ok()
        assert not os.path.exists(spec_path) and not rig.info("c1").exists()
        gone = podman.podman("run", "--rm", "--network", "none", "--device", f"{kind}={unit}", IMAGE, "true",
                             check=False)
        assert gone.returncode != 0 and "unresolvable CDI devices" in gone.stderr, "negative control"
    finally:
        try:
            os.unlink(spec_path)
        except FileNotFoundError:
            pass


def test_podman_43_refuses_cdi_0_6_0_and_annotations(podman, tmp_path):
    """Why the CNI writes cdiVersion 0.5.0 without annotations (measured, not assumed)."""
    tag = uuid.uuid4().hex[:6]
    kind = f"rdma-netns-test-{tag}.io/probe"
    path = f"{CDI_DIR}/rdma-netns-test-{tag}.json"
    os.makedirs(CDI_DIR, exist_ok=True)
    outcomes = {}
    try:
        for version, annotated in (("0.5.0", False), ("0.6.0", False), ("0.5.0", True), ("0.6.0", True)):
            spec = {"cdiVersion": version, "kind": kind,
                    "devices": [{"name": "u", "containerEdits": {"env": ["PROBE=1"]}}]}
            if annotated:
                spec["annotations"] = {"rdma-netns.io/owner": "c1"}
            with open(path, "w") as f:
                json.dump(spec, f)
            proc = podman.podman("run", "--rm", "--network", "none", "--device", f"{kind}=u", IMAGE,
                                 "sh", "-c", "echo $PROBE", check=False)
            outcomes[(version, annotated)] = proc.stdout.strip() if proc.returncode == 0 else proc.stderr.strip()
    finally:
        os.unlink(path)
    assert outcomes[("0.5.0", False)] == "1"
    for key in (("0.6.0", False), ("0.5.0", True), ("0.6.0", True)):
        assert "unresolvable CDI devices" in outcomes[key], (key, outcomes[key])
    PODMAN_REPORT.append("podman 4.3 CDI: 0.5.0 plain resolves; 0.6.0, and annotations at any version: "
                         f"{outcomes[('0.6.0', False)]}")
