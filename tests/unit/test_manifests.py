"""The Kubernetes manifests in conf/k8s: valid for the API server, and saying what they mean.

Every document is checked against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
unknown fields fail) for the oldest supported Kubernetes (1.29, the chart's kubeVersion) and the newest the validator ships.
The NetworkAttachmentDefinition is a CRD the schemas do not cover: its config goes through the
plugin's own check. Then the semantics: the Job needs no hostNetwork, the DaemonSet runs commands
the daemon's own parser accepts with a config the daemon accepts, every mount has its volume, and
the init container's install script does its job on a fake node.
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
import re
import shutil
import subprocess
import tempfile
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, installed_executable

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate (a test dependency)")

K8S = REPO / "conf" / "k8s"
OLDEST_K8S = "1.29"
NAD_API = "k8s.cni.cncf.io/v1"


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[tuple[str, dict]]:
    found = [(f"{f.name}#{i}:{d.get('kind')}", d) for f in sorted(K8S.glob("*.yaml"))
             for i, d in enumerate(documents(f))]
    assert found, "no manifests in conf/k8s"
    return found


def one(kind: str, filename: str) -> dict:
    docs = [d for d in documents(K8S / filename) if d.get("kind") == kind]
    assert len(docs) == 1, f"{filename}: expected one {kind}, found {len(docs)}"
    return docs[0]


def daemonset() -> dict:
    return one("DaemonSet", "rdma-netns-dp-daemonset.yaml")


def configmap() -> dict:
    return one("ConfigMap", "rdma-netns-dp-daemonset.yaml")


def container(pod_spec: dict, name: str, init: bool = False) -> dict:
    key = "initContainers" if init else "containers"
    matches = [c for c in pod_spec.get(key, []) if c["name"] == name]
    assert len(matches) == 1, f"no {key[:-1]} named {name}"
    return matches[0]


class FileProbe:
    """An exec probe of the manifest that reads a status file with the shell (the chart's
    "rdma-netns.fileProbe"), run as kubelet runs it, with its file moved to `where`."""

    def __init__(self, probe: dict, where: Path | None = None) -> None:
        command = probe["exec"]["command"]
        assert command[:2] == ["/bin/sh", "-c"], command
        found = re.search(r"\bf=(\S+);", command[2])
        assert found, command[2]
        self.file = found.group(1)
        self.script = command[2] if where is None else command[2].replace(f"f={self.file};", f"f={where};")

    def run(self, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/sh", "-c", self.script], capture_output=True, text=True, timeout=10,
                              env={"PATH": "/usr/bin:/bin", **(env or {})})


def check_config(tmp_path: Path, conflist: str, name: str = "net.conflist") -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(conflist)
    return subprocess.run([installed_executable(), "check-config", str(path)], capture_output=True, text=True)


def dp_args(command: list[str]):
    """Parse a container's rdma-netns-dp command exactly as the executable does (main.main)."""
    from rdma_netns_dp import main

    assert Path(command[0]).name == "rdma-netns-dp", command
    argv = list(command[1:])
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "serve")
    try:
        return main._parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports errors by exiting
        pytest.fail(f"rdma-netns-dp rejects {command}: exit {exc.code}")


# --- schema validation ------------------------------------------------------------------------

@pytest.mark.parametrize("version", [OLDEST_K8S, kubernetes_validate.latest_version()])
def test_every_manifest_is_valid_kubernetes(version: str):
    checked = 0
    for label, doc in all_documents():
        if doc.get("apiVersion") == NAD_API:
            continue  # a CRD: test_network_attachment_definition
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{label} is not valid for Kubernetes {version}: {where}: {exc.message}")
        checked += 1
    assert checked >= 4  # ConfigMap, DaemonSet, two Jobs


@pytest.mark.parametrize("mutate", [
    lambda ds: ds["spec"]["template"]["spec"]["containers"][0].__setitem__("hostNetwork", True),
    lambda ds: ds["spec"]["template"]["spec"].__setitem__("volumes", [{"name": "x", "hostpath": {"path": "/"}}]),
    lambda ds: ds["spec"]["template"]["spec"]["containers"][0]["livenessProbe"].__setitem__("exec", {"cmd": []}),
    lambda ds: ds["spec"]["template"]["spec"].__setitem__("hostNetwork", "yes"),
], ids=["field-in-wrong-place", "misspelled-volume-source", "misspelled-probe-field", "wrong-type"])
def test_the_validator_rejects_broken_manifests(mutate):
    broken = copy.deepcopy(daemonset())
    mutate(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, OLDEST_K8S, strict=True)


# --- the Multus NetworkAttachmentDefinition -------------------------------------------------------

def test_network_attachment_definition(tmp_path: Path):
    nad = one("NetworkAttachmentDefinition", "multus-network-attachment.yaml")
    assert nad["apiVersion"] == NAD_API
    assert set(nad) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(nad["spec"]) == {"config"} and isinstance(nad["spec"]["config"], str)
    name = nad["metadata"]["name"]
    assert name and len(name) <= 253 and name == name.lower() and "namespace" not in nad["metadata"]
    config = json.loads(nad["spec"]["config"])
    # Multus releases built on libcni < 1.2 know spec versions up to 1.0.0.
    assert config["cniVersion"] in ("0.3.1", "0.4.0", "1.0.0")
    assert [p["type"] for p in config["plugins"]] == ["rdma-netns"]
    out = check_config(tmp_path, nad["spec"]["config"])
    assert out.returncode == 0, out.stderr
    # Pairing (issue 36): only pods granted rdma/hca get rails. Multus and the Network Resources
    # Injector read the resource from the annotation; rdma-netns from the config, and accepts the
    # deviceID/pciBusID Multus then adds to the plugin.
    assert nad["metadata"]["annotations"]["k8s.v1.cni.cncf.io/resourceName"] == "rdma/hca"
    assert config["plugins"][0]["resourceName"] == "rdma/hca" and "pairing" not in config["plugins"][0]
    multus = copy.deepcopy(config)
    multus["plugins"][0].update(deviceID="hca-0003", pciBusID="hca-0003")
    out = check_config(tmp_path, json.dumps(multus), "multus.conflist")
    assert out.returncode == 0, out.stderr
    unpaired = copy.deepcopy(config)
    del unpaired["plugins"][0]["resourceName"]
    out = check_config(tmp_path, json.dumps(unpaired), "unpaired.conflist")
    assert out.returncode == 1 and "resourceName is missing" in out.stderr and '"pairing": false' in out.stderr
    # ... and the check can fail: a misspelled key is refused by name.
    config["plugins"][0]["railz"] = config["plugins"][0].pop("rails")
    out = check_config(tmp_path, json.dumps(config), "bad.conflist")
    assert out.returncode == 1 and "railz" in out.stderr


# --- the training Jobs ----------------------------------------------------------------------------

@pytest.mark.parametrize("filename", ["training-job.yaml", "training-job-multus.yaml"])
def test_training_job_needs_no_host_network(filename: str):
    job = one("Job", filename)
    assert job["apiVersion"] == "batch/v1"
    pod = job["spec"]["template"]["spec"]
    assert not pod.get("hostNetwork", False), "the point of rdma-netns: no hostNetwork"
    assert not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    assert isinstance(job["spec"].get("backoffLimit"), int)
    (train,) = pod["containers"]
    limits = train["resources"]["limits"]
    assert str(limits["rdma/hca"]) == "1" and str(limits["nvidia.com/gpu"]) == "8"
    security = train.get("securityContext", {})
    assert not security.get("privileged", False)
    assert "IPC_LOCK" in security["capabilities"]["add"]
    env = {e["name"]: e.get("value") for e in train.get("env", [])}
    assert "NCCL_IB_GID_INDEX" not in env  # it differs per pod in shared mode (see the comment there)
    if filename == "training-job.yaml":  # paired: the pod's CDI spec sets them from its own rails
        assert not {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_ADDR_FAMILY"} & set(env)


@pytest.mark.parametrize("filename", ["training-job.yaml", "training-job-multus.yaml"])
def test_training_job_spans_nodes_one_pod_each(filename: str):
    """NCCL leaves the node only when the job has pods on several nodes: an Indexed Job, one pod
    per node, torchrun's --nnodes equal to the pod count, the rendezvous at pod 0's name under
    the headless Service the file ships."""
    job, service = one("Job", filename), one("Service", filename)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] >= 2
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    command = pod["containers"][0]["command"]
    assert f"--nnodes={spec['completions']}" in command
    endpoint = next(a for a in command if a.startswith("--rdzv_endpoint="))
    port = endpoint.rsplit(":", 1)[1]
    assert endpoint == f"--rdzv_endpoint={job['metadata']['name']}-0.{service['metadata']['name']}:{port}"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def test_the_rdma_check_job_spans_two_nodes_and_finds_pod_0_by_name():
    job, service = one("Job", "rdma-check.yaml"), one("Service", "rdma-check.yaml")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    (check,) = pod["containers"]
    env = {e["name"]: e["value"] for e in check["env"]}
    assert env["PEER"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert str(check["resources"]["limits"]["rdma/hca"]) == "1" and not pod.get("hostNetwork")


def test_the_rdma_check_script_reads_what_cdi_published_and_waits_for_its_server(tmp_path: Path):
    """The Job's script with a stand-in ib_write_bw that records its arguments and refuses the
    client's first connections (perftest's own message): per rail the device and GID index from
    /etc/nccl.conf, the client retries until the server listens, any other failure fails the pod."""
    (check,) = one("Job", "rdma-check.yaml")["spec"]["template"]["spec"]["containers"]
    nccl = tmp_path / "nccl.conf"
    nccl.write_text("NCCL_IB_HCA==mlx5_bond_0:1,mlx5_bond_1:1\nNCCL_IB_GID_INDEX=5\nNCCL_SOCKET_IFNAME=eth0\n")
    script = check["command"][2].replace("/etc/nccl.conf", str(nccl))
    calls, bin_dir = tmp_path / "calls", tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "ib_write_bw"
    stand_in.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$*" >> {calls}
        n=$(wc -l < {calls})
        case "$*" in *fail-rtr*) echo "Failed to modify QP to RTR"; exit 1 ;; esac
        if [ $# -eq 12 ] && [ "$n" -le 2 ]; then echo "Couldn't connect to ${{12}}:${{10}}"; exit 1; fi
        echo " 65536      1000             9.99               9.98               0.019"
        """))
    stand_in.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FIRST_PORT": "18515"}

    def run(index: str, peer: str) -> subprocess.CompletedProcess:
        fast = script.replace("sleep 2", "sleep 0.01")
        return subprocess.run(["/bin/sh", "-c", fast], env={**env, "JOB_COMPLETION_INDEX": index, "PEER": peer},
                              capture_output=True, text=True, timeout=60)

    out = run("1", "10.0.0.1")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 4  # two refusals on rail 0, then one run per rail
    assert lines[2] == "-d mlx5_bond_0 -x 5 -s 65536 -n 1000 -p 18515 --report_gbits 10.0.0.1"
    assert lines[3] == "-d mlx5_bond_1 -x 5 -s 65536 -n 1000 -p 18516 --report_gbits 10.0.0.1"
    assert "rail 1 (mlx5_bond_1, GID index 5) -> 10.0.0.1:18516:" in out.stdout
    calls.unlink()
    out = run("0", "-")
    assert out.returncode == 0 and calls.read_text().splitlines()[0] == "-d mlx5_bond_0 -x 5 -s 65536 -n 1000 -p 18515 --report_gbits"
    calls.write_text("x\nx\nx\n")  # past the refusals: an RDMA failure is not retried
    out = run("1", "fail-rtr")
    assert out.returncode == 1 and "rail 0 (mlx5_bond_0, GID index 5): FAILED" in out.stdout, out.stdout
    assert "Failed to modify QP to RTR" in out.stdout
    nccl.write_text("NCCL_SOCKET_IFNAME=eth0\n")
    out = run("1", "10.0.0.1")
    assert out.returncode == 1 and "is the pod granted rdma/hca, CDI on?" in out.stdout


def test_multus_job_is_the_same_job_with_the_network_annotation():
    plain, multus = one("Job", "training-job.yaml"), one("Job", "training-job-multus.yaml")
    nad = one("NetworkAttachmentDefinition", "multus-network-attachment.yaml")
    annotations = multus["spec"]["template"]["metadata"]["annotations"]
    # rdma-netns names rail 0 after the CNI_IFNAME Multus passes: the annotation asks for rdma0.
    assert json.loads(annotations["k8s.v1.cni.cncf.io/networks"]) == [
        {"name": nad["metadata"]["name"], "interface": "rdma0"}]
    assert "annotations" not in plain["spec"]["template"]["metadata"]

    def env(job: dict) -> dict:
        return {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}

    # Multus attaches rdma-netns unpaired (no unit, no CDI env): the Job sets NCCL's variables itself.
    assert env(multus)["NCCL_SOCKET_IFNAME"] == "eth0" and "NCCL_SOCKET_IFNAME" not in env(plain)
    # Apart from the annotation and those variables, the Jobs are identical.
    a, b = copy.deepcopy(plain), copy.deepcopy(multus)
    del b["spec"]["template"]["metadata"]["annotations"]
    for job in (a, b):
        del job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert a == b


# --- the DaemonSet and its ConfigMap ---------------------------------------------------------------

def test_daemonset_placement_and_privileges():
    ds = daemonset()
    assert ds["metadata"]["namespace"] == "kube-system" and ds["metadata"]["name"] == "rdma-netns-dp"
    pod = ds["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"]["rdma-netns.io/rdma"] == "true"
    assert {"operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["hostNetwork"] is True
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    for c in pod["containers"] + pod["initContainers"]:
        security = c["securityContext"]
        assert not security.get("privileged", False), c["name"]
        assert security["capabilities"]["drop"] == ["ALL"], c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]
    main = container(pod, "rdma-netns-dp")
    assert "add" not in main["securityContext"]["capabilities"], "the daemon keeps no capability"


def granted(c: dict) -> set[str]:
    """The capabilities a container's process gets (runc: the added ones, after dropping ALL)."""
    caps = c.get("securityContext", {}).get("capabilities", {})
    assert caps.get("drop") == ["ALL"], f"{c['name']} must drop ALL first"
    return set(caps.get("add", []))


def test_net_admin_only_in_the_kernel_mode_init_container():
    """Least privilege (issue 36): the kernel-mode step is the only thing that needs CAP_NET_ADMIN
    in the host's network namespace, and it runs to completion before the daemon starts."""
    for path in sorted(K8S.glob("*.yaml")):
        for doc in documents(path):
            if doc.get("kind") not in ("DaemonSet", "Deployment", "Job"):
                continue
            pod = doc["spec"]["template"]["spec"]
            if not pod.get("hostNetwork"):
                continue  # a pod's own namespace: not the node's (training-job.yaml)
            for c in pod["containers"]:
                assert "NET_ADMIN" not in granted(c), f"{path.name}: long-running {c['name']} has NET_ADMIN"
                assert not c.get("securityContext", {}).get("privileged"), c["name"]
            for c in pod.get("initContainers", []):
                if "NET_ADMIN" in granted(c):
                    assert c["name"] == "kernel-mode" and granted(c) == {"NET_ADMIN"}, f"{path.name}: {c['name']}"
    pod = daemonset()["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]][0] == "kernel-mode", "the mode is set before anything else"
    init = container(pod, "kernel-mode", init=True)
    assert granted(init) == {"NET_ADMIN"}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_kernel_mode_step_runs_in_the_init_container_and_not_in_the_daemon():
    """The init container's command is a real `kernel-mode` call with the daemon's own config, which
    asks for the step; the daemon's command turns it off (it could not do it without NET_ADMIN)."""
    from rdma_netns_dp.config import load

    pod = daemonset()["spec"]["template"]["spec"]
    init = container(pod, "kernel-mode", init=True)
    main = container(pod, "rdma-netns-dp")
    init_args = dp_args(init["command"] + init.get("args", []))
    main_args = dp_args(main["command"] + main.get("args", []))
    assert init_args.command == "kernel-mode" and init_args.config == main_args.config
    assert dp_config().ensureKernelMode is True, "the ConfigMap asks for the step"
    assert main_args.ensureKernelMode is False, "the daemon must not try it (no NET_ADMIN)"
    for args, c in ((init_args, init), (main_args, main)):
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts[posixpath.dirname(args.config)]["name"] == "config", c["name"]
        assert mounts["/sys"]["name"] == "sys" and mounts["/sys"]["readOnly"], c["name"]
    overrides = {k: v for k, v in vars(main_args).items() if v is not None and k not in ("command", "config", "log_level")}
    assert load(None, overrides).ensureKernelMode is False, "the flag overrides the ConfigMap's true"


def as_container(c: dict, argv: list[str]) -> list[str]:
    """argv run with exactly the capabilities the manifest gives `c` (setpriv: the bounding set
    and the inheritable set cut to them, as runc does), as uid 0."""
    setpriv = shutil.which("setpriv") or pytest.skip("needs setpriv (util-linux)")
    if os.geteuid() != 0:
        pytest.skip("needs root (to run as the container's uid 0 with its capabilities)")
    keep = ",".join(f"+{cap.lower()}" for cap in sorted(granted(c)))
    bounding = "-all" + (f",{keep}" if keep else "")
    return [setpriv, "--bounding-set", bounding, "--inh-caps", "-all", "--no-new-privs", *argv]


def test_the_kernel_mode_init_container_exits_0_on_a_node_in_the_right_mode(tmp_path: Path):
    """Its command with the ConfigMap's dp.yaml and only NET_ADMIN: a shared-mode kernel is what the
    shared config needs (exit 0, logged); a tree without RDMA is not an error either."""
    from tests.fake_rdma_sysfs import FakeRdmaSysfs

    init = container(daemonset()["spec"]["template"]["spec"], "kernel-mode", init=True)
    config_file = tmp_path / "dp.yaml"
    config_file.write_text(configmap()["data"]["dp.yaml"])
    fake = FakeRdmaSysfs(tmp_path / "node", netns_mode="Y")
    fake.add_pci_device("mlx5_0", "0000:3b:00.0", "eth1")
    dp = shutil.which("rdma-netns-dp", path=os.path.dirname(sys.executable)) or pytest.fail("no rdma-netns-dp")
    command = [dp, *init["command"][1:]]
    command[command.index("--config") + 1] = str(config_file)
    out = subprocess.run(as_container(init, [*command, "--sysfs-root", str(fake.sys)]),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kernel RDMA netns mode is as needed" in out.stdout + out.stderr
    empty = tmp_path / "no-rdma"
    empty.mkdir()
    out = subprocess.run(as_container(init, [*command, "--sysfs-root", str(empty)]),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "ib_core not loaded" in out.stdout + out.stderr, out.stdout + out.stderr
    config_file.write_text("mode: sideways\n")
    out = subprocess.run([*command, "--sysfs-root", str(fake.sys)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "invalid configuration" in out.stderr


def dp_config():
    from rdma_netns_dp.config import parse

    return parse(configmap()["data"]["dp.yaml"], "ConfigMap rdma-netns-dp-config dp.yaml")


def test_configmap_dp_yaml_is_the_shipped_shared_config():
    from rdma_netns_dp.config import ConfigError, parse

    config = dp_config()
    assert config.mode == "shared" and [r.name for r in config.resources] == ["rdma/hca"]
    shipped = parse((REPO / "conf" / "rdma-netns-dp-shared.yaml").read_text(), "rdma-netns-dp-shared.yaml")
    assert config.model_dump() == shipped.model_dump(), "the ConfigMap drifted from conf/rdma-netns-dp-shared.yaml"
    with pytest.raises(ConfigError, match="sharedUnitz"):
        parse(configmap()["data"]["dp.yaml"].replace("sharedUnits", "sharedUnitz"), "mutated")


def test_configmap_conflist_validates_and_is_the_shipped_one(tmp_path: Path):
    text = configmap()["data"]["rdma-netns.conflist"]
    out = check_config(tmp_path, text)
    assert out.returncode == 0, out.stderr
    shipped = json.loads((REPO / "conf" / "rdma-netns-shared-8rails.conflist").read_text())
    assert json.loads(text) == shipped, "the ConfigMap drifted from conf/rdma-netns-shared-8rails.conflist"
    nad = json.loads(one("NetworkAttachmentDefinition", "multus-network-attachment.yaml")["spec"]["config"])
    paired = copy.deepcopy(shipped)  # the NAD pairs with kubelet's grants; the node-wide conflist may not
    del paired["plugins"][0]["pairing"]
    paired["plugins"][0]["resourceName"] = "rdma/hca"
    assert dict(nad, cniVersion=None) == dict(paired, cniVersion=None)


def test_main_container_runs_a_real_rdma_netns_dp_invocation():
    pod = daemonset()["spec"]["template"]["spec"]
    main = container(pod, "rdma-netns-dp")
    args = dp_args(main["command"] + main.get("args", []))
    assert args.command == "serve" and args.config
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    config_mount = mounts[posixpath.dirname(args.config)]
    volume = {v["name"]: v for v in pod["volumes"]}[config_mount["name"]]
    assert volume["configMap"]["name"] == configmap()["metadata"]["name"]
    assert posixpath.basename(args.config) in configmap()["data"]


def test_the_device_plugins_probes_read_its_files_with_the_shell(tmp_path: Path):
    """Liveness and start-up: the health file is fresh (the daemon's loop rewrites it every
    interval; a few missed ones are allowed, not zero). Readiness: its `ready` file (daemon.py)
    says ready. No Python starts per probe (on a loaded node a timed-out exec probe keeps running)."""
    from rdma_netns_dp.daemon import ready_file

    main = container(daemonset()["spec"]["template"]["spec"], "rdma-netns-dp")
    config = dp_config()
    health, ready = tmp_path / "health.json", tmp_path / "ready"
    live, start = FileProbe(main["livenessProbe"], health), FileProbe(main["startupProbe"], health)
    readiness = FileProbe(main["readinessProbe"], ready)
    assert live.file == start.file == config.healthFile
    assert readiness.file == ready_file(config.healthFile)
    max_age = int(re.search(r'"\$age" -le (\d+)', live.script).group(1))
    assert 3 * config.healthIntervalSeconds <= max_age <= 60
    for probe in ("livenessProbe", "readinessProbe"):
        assert main[probe]["timeoutSeconds"] >= 2 and main[probe].get("failureThreshold", 3) >= 2

    out = live.run()
    assert out.returncode == 1 and "not written yet" in out.stdout
    health.write_text("{}")
    assert live.run().returncode == 0 and start.run().returncode == 0
    old = time.time() - max_age - 5
    os.utime(health, (old, old))
    out = live.run()
    assert out.returncode == 1 and "not rewritten for" in out.stdout, out.stdout
    ready.write_text("not ready: not registered with kubelet: rdma/hca\n")
    out = readiness.run()
    assert out.returncode == 1 and "not registered with kubelet: rdma/hca" in out.stdout
    ready.write_text("ready\n")
    assert readiness.run().returncode == 0


def test_every_mount_has_its_volume_and_every_volume_is_used():
    pod = daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert len(volumes) == len(pod["volumes"]), "duplicate volume names"
    used = set()
    for c in pod["containers"] + pod["initContainers"]:
        paths = [m["mountPath"] for m in c["volumeMounts"]]
        assert len(paths) == len(set(paths)), f"{c['name']}: a path is mounted twice"
        for m in c["volumeMounts"]:
            assert m["name"] in volumes, f"{c['name']} mounts {m['name']}, which is not a volume"
            used.add(m["name"])
    assert used == set(volumes), f"volumes never mounted: {set(volumes) - used}"
    for name, v in volumes.items():
        if "hostPath" in v:
            assert posixpath.isabs(v["hostPath"]["path"]), name


def test_the_daemon_can_reach_every_path_its_config_uses():
    pod = daemonset()["spec"]["template"]["spec"]
    main = container(pod, "rdma-netns-dp")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = main["volumeMounts"]

    def mount_of(path: str) -> dict:
        best = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert best, f"the daemon uses {path}, but nothing is mounted there"
        return max(best, key=lambda m: len(m["mountPath"]))

    def host_path(path: str) -> str | None:
        m = mount_of(path)
        source = volumes[m["name"]].get("hostPath")
        if not source:
            return None
        return posixpath.normpath(posixpath.join(source["path"], posixpath.relpath(path, m["mountPath"])))

    config = dp_config()
    # Sockets kubelet must find: the same paths on the host, writable.
    for folder in ("device-plugins", "plugins_registry"):
        path = posixpath.join(config.kubeletDir, folder)
        assert host_path(path) == path and not mount_of(path).get("readOnly")
    assert host_path(config.sysfsRoot) == "/sys" and mount_of(config.sysfsRoot)["readOnly"]
    assert host_path(config.cniStateDir) == "/var/lib/cni/rdma-netns" and mount_of(config.cniStateDir)["readOnly"]
    assert host_path(config.cdi.specDir) == config.cdi.specDir and not mount_of(config.cdi.specDir).get("readOnly")
    health = mount_of(config.healthFile)
    assert not health.get("readOnly") and "emptyDir" in volumes[health["name"]]
    # The CNI state folder is the plugin's default, which is what the conflist uses.
    conflist = json.loads(configmap()["data"]["rdma-netns.conflist"])
    assert all(p.get("stateDir", config.cniStateDir) == config.cniStateDir for p in conflist["plugins"])
    # Pairing: the broker socket the chained entry names is the daemon's, at the same host path (the
    # CNI plugin runs on the host), and kubelet's PodResources socket is reachable from the daemon.
    entry = json.loads(configmap()["data"]["rdma-netns-chained-entry.json"])
    assert entry["podGrantsSocket"] == config.podGrantsSocket
    assert host_path(config.podGrantsSocket) == config.podGrantsSocket
    assert not mount_of(config.podGrantsSocket).get("readOnly")
    assert host_path(entry["podResourcesSocket"]) == entry["podResourcesSocket"]


def test_the_kernel_mode_step_exits_1_when_the_kernel_refuses_for_another_reason(tmp_path: Path):
    """A mode to set and nothing blocking it (no other process's network namespace in sight, no
    named one), but no CAP_NET_ADMIN: the kernel refuses (EPERM, or no NETLINK_RDMA at all
    on this machine), which must stop the pod rather than leave the mode silently wrong. Never run
    with the capability here: it would change this machine's mode."""
    from tests.fake_rdma_sysfs import FakeRdmaSysfs

    init = container(daemonset()["spec"]["template"]["spec"], "kernel-mode", init=True)
    config_file = tmp_path / "dp.yaml"
    config_file.write_text(configmap()["data"]["dp.yaml"])  # mode: shared, ensureKernelMode: true
    fake = FakeRdmaSysfs(tmp_path / "node", netns_mode="N")  # the kernel in exclusive mode
    dp = shutil.which("rdma-netns-dp", path=os.path.dirname(sys.executable)) or pytest.fail("no rdma-netns-dp")
    command = [dp, *init["command"][1:]]
    command[command.index("--config") + 1] = str(config_file)
    no_caps = as_container({"name": "none", "securityContext": {"capabilities": {"drop": ["ALL"]}}},
                           [*command, "--sysfs-root", str(fake.sys)])
    empty = tmp_path / "no-netns"
    empty.mkdir()
    # Its own PID and mount namespaces: no other process in /proc, an empty /run/netns (private
    # mounts: the machine's stay as they are).
    hide = 'if [ -d /run/netns ]; then mount --bind "$0" /run/netns; fi; exec "$@"'
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", hide, str(empty), *no_caps],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "setting the kernel RDMA netns mode failed" in out.stdout + out.stderr


def test_the_daemon_starts_with_the_configmap_config_and_its_probe_passes(tmp_path: Path):
    """The main container's command with the ConfigMap's dp.yaml, paths moved under tmp_path, run
    with the manifest's capabilities (none): it registers, serves and writes its health file."""
    from tests.fake_rdma_sysfs import FakeRdmaSysfs

    pod = daemonset()["spec"]["template"]["spec"]
    main = container(pod, "rdma-netns-dp")
    config_file = tmp_path / "dp.yaml"
    config_file.write_text(configmap()["data"]["dp.yaml"])
    fake = FakeRdmaSysfs(tmp_path / "node", netns_mode="Y")
    fake.add_pci_device("mlx5_0", "0000:3b:00.0", "eth1")
    kubelet = Path(tempfile.mkdtemp(prefix="dpk-", dir="/tmp"))  # unix socket paths stay short
    (kubelet / "device-plugins").mkdir()
    health = tmp_path / "run" / "health.json"
    dp = shutil.which("rdma-netns-dp", path=os.path.dirname(sys.executable)) or pytest.fail("no rdma-netns-dp")
    command = [dp, *main["command"][1:]]
    command[command.index("--config") + 1] = str(config_file)
    command += ["--kubelet-dir", str(kubelet), "--sysfs-root", str(fake.sys),
                "--health-file", str(health), "--cni-state-dir", str(tmp_path / "cni"),
                "--cdi-dir", str(tmp_path / "cdi"), "--pod-grants-socket", str(kubelet / "pg.sock"),
                # no listener on the machine's interfaces, no FIFO in its /run (tests/netns/test_metrics.py)
                "--metrics-port", "0"]
    live = FileProbe(main["livenessProbe"], health)
    readiness = FileProbe(main["readinessProbe"], health.parent / "ready")
    # With the manifest's capabilities (none): everything the daemon does must work without them.
    proc = subprocess.Popen(as_container(main, command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not health.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read().decode()
        out = live.run()
        assert out.returncode == 0, out.stdout
        while not (health.parent / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        out = readiness.run()  # no kubelet here to register with: not Ready, and it says why
        assert out.returncode == 1 and "not ready: not registered with kubelet: rdma/hca" in out.stdout, out.stdout
        status = json.loads(health.read_text())
        assert status["resources"]["rdma/hca"]["devices"] == 1000
        assert (kubelet / "device-plugins" / "rdma-netns-rdma_hca.sock").is_socket()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(kubelet, ignore_errors=True)
    assert proc.returncode == 0
    assert live.run().returncode == 1  # the daemon removed its health file: the probe fails
    assert "not written yet" in readiness.run().stdout  # and its ready file


# --- the init container's install script ------------------------------------------------------------

def container_env(c: dict) -> dict[str, str]:
    """A container's env as the kubelet resolves it (plain values, this ConfigMap's keys)."""
    out = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            assert ref["name"] == configmap()["metadata"]["name"] and not ref.get("optional")
            out[e["name"]] = configmap()["data"][ref["key"]]
    return out


def install_env(tmp_path: Path) -> tuple[str, dict, Path, Path]:
    """A fake image tree and a fake host; the script with the container's env pointed at them."""
    pod = daemonset()["spec"]["template"]["spec"]
    init = container(pod, "install-cni", init=True)
    assert init["command"][:2] == ["/bin/sh", "-ec"]
    script = init["command"][2]
    prefix = tmp_path / "image" / "opt" / "rdma-netns-ds"
    release = prefix / "0.1.0-abc"
    (release / "venv" / "bin").mkdir(parents=True)
    shim = release / "venv" / "bin" / "rdma-netns"
    shim.write_text(f"#!/bin/sh\nexec {installed_executable()} \"$@\"\n")
    shim.chmod(0o755)
    (release / "BUILD-STAMP").write_text("stamp-1\n")
    (prefix / "current").symlink_to("0.1.0-abc")
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    for key, value in configmap()["data"].items():
        (config_dir / key).write_text(value)
    host = tmp_path / "host"
    host.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOST": str(host), "PREFIX": str(prefix), "CONFIG_DIR": str(config_dir)}
    env.update(container_env(init))
    mounted = {m["mountPath"] for m in init["volumeMounts"]}
    assert {"/host/opt/cni/bin", "/host/etc/cni/net.d", "/host/opt/rdma-netns-ds", "/etc/rdma-netns"} <= mounted
    return script, env, host, prefix


def run_script(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=60)


def test_install_script_on_a_fake_node(tmp_path: Path):
    script, env, host, prefix = install_env(tmp_path)
    env.update(INSTALL_CONFLIST="true", RDMA_FOR_NON_HOSTNETWORK_PODS="false")  # the standalone way
    on_host = Path(f"{host}{prefix}")
    stale = on_host / "0.0.9-old"
    stale.mkdir(parents=True)
    (stale / "BUILD-STAMP").write_text("old\n")
    foreign = on_host / "something-else"
    foreign.mkdir()

    out = run_script(script, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (on_host / "0.1.0-abc" / "venv" / "bin" / "rdma-netns").exists()
    assert not (on_host / "0.1.0-abc.partial").exists()
    assert not stale.exists() and foreign.exists()  # old releases go, folders it did not write stay
    launcher = host / "opt" / "cni" / "bin" / "rdma-netns"
    assert launcher.read_text().startswith("#!") and launcher.stat().st_mode & 0o755 == 0o755
    version = subprocess.run([str(launcher)], input=b"{}", capture_output=True, env={"CNI_COMMAND": "VERSION"})
    assert version.returncode == 0 and "1.1.0" in json.loads(version.stdout)["supportedVersions"]
    conf = host / "etc" / "cni" / "net.d" / env["CONFLIST_NAME"]
    assert json.loads(conf.read_text()) == json.loads(Path(env["CONFIG_DIR"], "rdma-netns.conflist").read_text())
    assert not list(conf.parent.glob(".*.tmp"))

    # Again: idempotent, and an admin's edit of the config survives.
    conf.write_text('{"edited": true}')
    out = run_script(script, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "already on the host" in out.stdout and "keeping the existing" in out.stdout
    assert conf.read_text() == '{"edited": true}'

    # A different build under the same release name is refused, not mixed in.
    (on_host / "0.1.0-abc" / "BUILD-STAMP").write_text("stamp-2\n")
    out = run_script(script, env)
    assert out.returncode == 1 and "another build" in out.stderr


def test_install_script_refuses_an_invalid_conflist_and_can_skip_it(tmp_path: Path):
    script, env, host, _ = install_env(tmp_path)
    env.update(INSTALL_CONFLIST="true", RDMA_FOR_NON_HOSTNETWORK_PODS="false")
    Path(env["CONFIG_DIR"], "rdma-netns.conflist").write_text(
        '{"cniVersion": "1.1.0", "name": "x", "plugins": [{"type": "rdma-netns", "railz": []}]}')
    out = run_script(script, env)
    assert out.returncode != 0 and "railz" in out.stderr
    assert not (host / "etc" / "cni" / "net.d" / env["CONFLIST_NAME"]).exists()
    out = run_script(script, dict(env, INSTALL_CONFLIST="false"))
    assert out.returncode == 0, out.stderr
    assert not (host / "etc" / "cni" / "net.d" / env["CONFLIST_NAME"]).exists()


# --- "RDMA for non-hostNetwork pods": chained into the primary CNI config -----------------------------

CALICO = """{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {"type": "calico", "datastore_type": "kubernetes", "ipam": {"type": "calico-ipam"}},
    {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}
  ]
}
"""


def test_the_switch_is_on_by_default_and_the_entry_is_the_shipped_one(tmp_path: Path):
    pod = daemonset()["spec"]["template"]["spec"]
    data = configmap()["data"]
    assert data["RDMA_FOR_NON_HOSTNETWORK_PODS"] == "true"
    init = container(pod, "install-cni", init=True)
    assert container_env(init)["RDMA_FOR_NON_HOSTNETWORK_PODS"] == "true"
    assert container_env(init)["INSTALL_CONFLIST"] == "false", "one way at a time: chained by default"
    entry = json.loads(data["rdma-netns-chained-entry.json"])
    assert entry == json.loads((REPO / "conf" / "rdma-netns-chained-entry.json").read_text()), \
        "the ConfigMap drifted from conf/rdma-netns-chained-entry.json"
    assert entry["type"] == "rdma-netns" and entry["resourceName"] == "rdma/hca" and len(entry["rails"]) == 8
    conflist = {"cniVersion": "1.0.0", "name": "k8s-pod-network",
                "plugins": [{"type": "calico"}, entry]}
    out = check_config(tmp_path, json.dumps(conflist))
    assert out.returncode == 0, out.stderr


def test_watch_sidecar_mounts_what_the_init_container_writes():
    pod = daemonset()["spec"]["template"]["spec"]
    init, watch = container(pod, "install-cni", init=True), container(pod, "cni-conf-watch")
    assert container_env(watch)["RDMA_FOR_NON_HOSTNETWORK_PODS"] == container_env(init)["RDMA_FOR_NON_HOSTNETWORK_PODS"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    def host_mounts(c: dict) -> dict[str, str]:
        return {m["mountPath"]: volumes[m["name"]].get("hostPath", {}).get("path") for m in c["volumeMounts"]}

    for path, host in {"/host/etc/cni/net.d": "/etc/cni/net.d",
                       "/host/var/lib/rdma-netns/cni-conf": "/var/lib/rdma-netns/cni-conf"}.items():
        assert host_mounts(init)[path] == host_mounts(watch)[path] == host, path
    assert watch["securityContext"]["readOnlyRootFilesystem"] is True
    assert set(watch["securityContext"]["capabilities"]["add"]) <= {"CHOWN", "DAC_OVERRIDE", "FOWNER"}
    script = watch["command"][2]
    assert "cni-conf watch" in script and "/etc/rdma-netns/rdma-netns-chained-entry.json" in script
    assert "--keep-on-exit" in script, "restarts and upgrades keep the entry (no window without rails)"


def test_install_script_chains_into_the_primary_and_the_switch_off_restores_it(tmp_path: Path):
    script, env, host, _ = install_env(tmp_path)
    conf_dir = host / "etc" / "cni" / "net.d"
    conf_dir.mkdir(parents=True)
    primary = conf_dir / "10-calico.conflist"
    primary.write_text(CALICO)
    out = run_script(script, env)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(primary.read_text())
    assert [p["type"] for p in doc["plugins"]] == ["calico", "portmap", "rdma-netns"]
    assert sorted(os.listdir(conf_dir)) == ["10-calico.conflist"], "no standalone conflist, no temp file"
    state = host / "var" / "lib" / "rdma-netns" / "cni-conf"
    assert state.stat().st_mode & 0o777 == 0o700

    inode = primary.stat().st_ino
    out = run_script(script, env)  # a restarted pod: nothing to do
    assert out.returncode == 0 and "already" in out.stderr and primary.stat().st_ino == inode

    both = run_script(script, dict(env, INSTALL_CONFLIST="true"))
    assert both.returncode == 1 and "set only one" in both.stderr
    bad = run_script(script, dict(env, RDMA_FOR_NON_HOSTNETWORK_PODS="yes"))
    assert bad.returncode == 1 and "must be" in bad.stderr

    off = run_script(script, dict(env, RDMA_FOR_NON_HOSTNETWORK_PODS="false"))
    assert off.returncode == 0, off.stderr
    assert primary.read_text() == CALICO, "byte for byte as the cluster CNI wrote it"
    assert list(state.iterdir()) == []


def test_install_script_refuses_an_entry_the_plugin_would_refuse(tmp_path: Path):
    script, env, host, _ = install_env(tmp_path)
    conf_dir = host / "etc" / "cni" / "net.d"
    conf_dir.mkdir(parents=True)
    (conf_dir / "10-calico.conflist").write_text(CALICO)
    entry = Path(env["CONFIG_DIR"], "rdma-netns-chained-entry.json")
    entry.write_text(entry.read_text().replace('"rails"', '"railz"'))
    out = run_script(script, env)
    assert out.returncode != 0 and "railz" in out.stderr
    assert (conf_dir / "10-calico.conflist").read_text() == CALICO


def test_watch_sidecar_command_for_real(tmp_path: Path):
    """The sidecar's script, its /host and /etc/rdma-netns paths moved under tmp_path, run with the
    installed rdma-netns: re-inserts after the cluster CNI rewrites its file, keeps it on SIGTERM."""
    pod = daemonset()["spec"]["template"]["spec"]
    watch = container(pod, "cni-conf-watch")
    assert watch["command"][:2] == ["/bin/sh", "-ec"]
    host, config = tmp_path / "host", tmp_path / "config"
    conf_dir = host / "etc" / "cni" / "net.d"
    conf_dir.mkdir(parents=True)
    config.mkdir()
    for key, value in configmap()["data"].items():
        (config / key).write_text(value)
    ready = tmp_path / "ready"
    script = (watch["command"][2].replace("/host/", f"{host}/").replace("/etc/rdma-netns/", f"{config}/")
              .replace(FileProbe(watch["readinessProbe"]).file, str(ready)))
    probe = FileProbe(watch["readinessProbe"], ready)
    env = {"PATH": f"{os.path.dirname(installed_executable())}:/usr/bin:/bin", **container_env(watch)}
    primary = conf_dir / "10-calico.conflist"
    primary.write_text(CALICO)

    def chained() -> bool:
        try:
            return json.loads(primary.read_text())["plugins"][-1]["type"] == "rdma-netns"
        except (ValueError, OSError):
            return False

    def wait(predicate, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "not within the time"
            time.sleep(0.05)

    out = probe.run(env)
    assert out.returncode == 1 and "not written yet" in out.stdout, out.stdout
    proc = subprocess.Popen(["/bin/sh", "-ec", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait(chained)
        wait(ready.exists)
        # Chained, but this machine has none of the ConfigMap's rail netdevs: not Ready, and why.
        out = probe.run(env)
        assert out.returncode == 1, out.stdout
        assert "every RDMA pod's ADD would fail" in out.stdout and "no netdev" in out.stdout, out.stdout
        rewritten = CALICO.replace("kubernetes", "etcdv3")
        tmp = conf_dir / ".calico.tmp"
        tmp.write_text(rewritten)
        os.rename(tmp, primary)
        wait(chained, 5)
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert chained(), "the entry stays when the pod terminates (a restart or an upgrade follows)"
    assert json.loads(primary.read_text())["plugins"][:-1] == json.loads(rewritten)["plugins"]

    off = subprocess.Popen(["/bin/sh", "-ec", script], env=dict(env, RDMA_FOR_NON_HOSTNETWORK_PODS="false"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    off.terminate()
    out, _ = off.communicate(timeout=10)
    assert off.returncode == 0 and "nothing to watch" in out
    ready.unlink()
    assert probe.run(dict(env, RDMA_FOR_NON_HOSTNETWORK_PODS="false")).returncode == 0  # off: always Ready
    assert chained(), "the switch off is the init container's to act on, not the idle sidecar's"


def test_metrics_on_loopback_and_the_sidecars_probe():
    """/metrics listens on the node's loopback (hostNetwork: any other address is every node
    address), so no scrape annotation or container port points Prometheus at an address it cannot
    reach (docs/metrics.md: the proxy brings them); the code's default is the same. The sidecar's
    readiness probe asks for the entry in the folder it watches."""
    from rdma_netns_dp.config import MetricsConfig

    template = daemonset()["spec"]["template"]
    pod = template["spec"]
    assert dp_config().metrics.port == 9478
    assert dp_config().metrics.address == MetricsConfig().address == "127.0.0.1"
    main = container(pod, "rdma-netns-dp")
    assert "ports" not in main and "prometheus.io/scrape" not in template["metadata"].get("annotations", {})
    watcher = container(pod, "cni-conf-watch")
    probe = FileProbe(watcher["readinessProbe"])
    watch = " ".join(watcher["command"][-1].split())
    # The probe reads the file the watch keeps, in a folder of the pod's own (not the host's: a
    # file an earlier pod left there could pass once).
    assert f"--ready-file {probe.file}" in watch
    mount = {m["mountPath"]: m["name"] for m in watcher["volumeMounts"]}[posixpath.dirname(probe.file)]
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[mount]
    for flag in ("--conf-dir /host/etc/cni/net.d", "--state-dir /host/var/lib/rdma-netns/cni-conf"):
        assert flag in watch
    # The FIFO the daemon reads is where the shipped CNI configs write (their default).
    from rdma_netns.events import DEFAULT_PATH

    assert dp_config().metrics.cniEventsFifo == DEFAULT_PATH
    assert os.path.dirname(DEFAULT_PATH) == os.path.dirname(dp_config().podGrantsSocket)


def test_the_admission_policy_in_security_md_is_valid_kubernetes():
    """docs/security.md's ValidatingAdmissionPolicy (no NET_ADMIN in pods with rails, issue 36),
    as an admin copies it: strict against the newest schemas (the policy's v1 is 1.30+)."""
    text = (REPO / "docs" / "security.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    docs = [d for b in blocks for d in yaml.safe_load_all(textwrap.dedent(b)) if d]
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    policy, binding = docs
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "'rdma/hca'" in policy["spec"]["variables"][1]["expression"]
    assert "NET_ADMIN" in policy["spec"]["validations"][0]["expression"]
