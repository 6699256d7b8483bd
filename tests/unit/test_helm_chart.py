"""The Helm chart (deploy/helm/rdma-netns): the plain manifests are its render, it passes `helm lint
--strict`, every render is valid Kubernetes, and its values reach the objects they name (a node pool
of RoCE LAG nodes, a pinned image, another fabric prefix, a config change that rolls the pods).

Helm is built from its Go module (integration/helm/build.sh, cached): without Go the tests skip,
except in CI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.unit.test_manifests import check_config

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate (a test dependency)")

CHART = REPO / "deploy" / "helm" / "rdma-netns"
LAG_VALUES = CHART / "examples" / "roce-lag-pool.yaml"
CHECKSUM = "rdma-netns.io/config-sha256"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def helm() -> str:
    if shutil.which("go") is None:
        if os.environ.get("CI"):
            pytest.fail("the chart's tests need Go to build Helm (integration/helm/build.sh); CI must provide it")
        pytest.skip("needs Go (integration/helm/build.sh builds Helm from its module)")
    proc = subprocess.run([str(REPO / "integration" / "helm" / "build.sh")], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def render(helm: str, *args: str) -> list[dict]:
    proc = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "kube-system", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), [d["kind"] for d in docs]
    return kinds


def entry_of(docs: list[dict]) -> dict:
    return json.loads(by_kind(docs)["ConfigMap"]["data"]["rdma-netns-chained-entry.json"])


def images(docs: list[dict]) -> set[str]:
    specs = [d["spec"]["template"]["spec"] if d["kind"] == "DaemonSet" else d["spec"] for d in docs
             if d["kind"] in ("DaemonSet", "Pod")]
    return {c["image"] for spec in specs for c in [*spec.get("initContainers", []), *spec["containers"]]}


def test_the_plain_manifests_are_the_charts_render(helm):
    proc = subprocess.run([str(REPO / "scripts" / "render-manifests.sh"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_render_check_can_fail(helm, tmp_path: Path):
    """The check compares bytes: a chart whose default changed no longer matches conf/k8s."""
    chart = tmp_path / "rdma-netns"
    shutil.copytree(CHART, chart)
    values = chart / "values.yaml"
    values.write_text(values.read_text().replace("sharedUnits: 1000", "sharedUnits: 999"))
    proc = subprocess.run([helm, "template", "rdma-netns", str(chart), "--namespace", "kube-system"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "sharedUnits: 999" in proc.stdout
    assert proc.stdout not in (REPO / "conf" / "k8s" / "rdma-netns-dp-daemonset.yaml").read_text()


@pytest.mark.parametrize("extra", [[], ["--set", "pool=lag", "-f", str(LAG_VALUES)], ["--set", "component=uninstall"]],
                         ids=["defaults", "lag-pool", "uninstall"])
def test_helm_lint_strict_and_every_render_is_valid_kubernetes(helm, extra):
    proc = subprocess.run([helm, "lint", "--strict", str(CHART), *extra], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    docs = render(helm, *extra)
    assert docs
    for version in ("1.29", kubernetes_validate.latest_version()):
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_a_lag_pool_release_has_its_own_objects_nodes_and_rails(helm, tmp_path: Path):
    docs = render(helm, "--set", "pool=lag", "-f", str(LAG_VALUES))
    kinds = by_kind(docs)
    config, ds = kinds["ConfigMap"], kinds["DaemonSet"]
    assert ds["metadata"]["name"] == "rdma-netns-dp-lag"
    assert config["metadata"]["name"] == "rdma-netns-dp-lag-config"
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "rdma-netns-dp", "rdma-netns.io/pool": "lag"}
    pod = ds["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux", "rdma-netns.io/rdma": "true",
                                           "rdma-netns.io/pool": "lag"}
    # Every reference to the ConfigMap names the pool's.
    refs = [e["valueFrom"]["configMapKeyRef"]["name"] for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]
            for e in c.get("env", []) if "valueFrom" in e]
    refs += [v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v]
    assert refs and set(refs) == {"rdma-netns-dp-lag-config"}
    entry = entry_of(docs)
    assert entry == dict(json.loads((REPO / "conf" / "rdma-netns-chained-entry-lag.json").read_text()))
    out = check_config(tmp_path, json.dumps({"cniVersion": "1.0.0", "name": "k8s-pod-network",
                                             "plugins": [{"type": "calico"}, entry]}))
    assert out.returncode == 0, out.stderr
    conflist = json.loads(config["data"]["rdma-netns.conflist"])
    assert conflist["name"] == "rdma-4rails" and conflist["plugins"][0]["link"] == "ipvlan"
    out = check_config(tmp_path, json.dumps(conflist), "standalone.conflist")
    assert out.returncode == 0, out.stderr
    # Two pools' objects never collide, and the release without a pool stays off the pool's nodes.
    default = render(helm)
    assert not {(d["kind"], d["metadata"]["name"]) for d in default} & {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert "affinity" not in pod["spec"]
    terms = by_kind(default)["DaemonSet"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "rdma-netns.io/pool", "operator": "DoesNotExist"}]}]


def test_a_digest_pins_every_container(helm):
    assert images(render(helm)) == {"registry.example.com/rdma-netns/rdma-netns:0.2.0"}
    pinned = render(helm, "--set", f"image.digest={DIGEST}", "--set", "image.repository=localhost/rdma-netns/rdma-netns")
    assert images(pinned) == {f"localhost/rdma-netns/rdma-netns@{DIGEST}"}
    uninstall = render(helm, "--set", "component=uninstall", "--set", f"image.digest={DIGEST}")
    assert images(uninstall) == {f"registry.example.com/rdma-netns/rdma-netns@{DIGEST}"}


def test_the_fabric_prefix_reaches_the_ranges_and_routes(helm, tmp_path: Path):
    entry = entry_of(render(helm, "--set", "fabric.prefix=fd20:aa::/32"))
    assert entry["rangeFromNodeAddress"] == {"prefixLength": 112, "within": "fd20:aa::/32"}
    assert entry["ipam"]["routes"] == [{"dst": "fd20:aa::/32"}]
    routed = entry_of(render(helm, "--set", "fabric.prefix=fd20:aa::/32", "--set-json",
                             'fabric.routes=[{"dst": "fd20::/16"}, {"dst": "fd30::/16"}]'))
    assert routed["ipam"]["routes"] == [{"dst": "fd20::/16"}, {"dst": "fd30::/16"}]
    out = check_config(tmp_path, json.dumps({"cniVersion": "1.0.0", "name": "net", "plugins": [{"type": "calico"}, routed]}))
    assert out.returncode == 0, out.stderr


def test_a_rail_keeps_its_own_keys(helm):
    rails = [{"rdmaDevice": "mlx5_bond_0", "ifname": "rdma0"}, {"netdev": "bond1", "ifname": "rdma1", "mtu": 4200}]
    entry = entry_of(render(helm, "--set-json", f"rails={json.dumps(rails)}"))
    assert entry["rails"] == rails


def test_a_config_change_rolls_the_pods_and_an_image_change_alone_does_not_change_the_checksum(helm):
    def checksum(*args: str) -> str:
        return by_kind(render(helm, *args))["DaemonSet"]["spec"]["template"]["metadata"]["annotations"][CHECKSUM]

    base = checksum()
    assert checksum("--set", "rails[0].netdev=eth9") != base
    assert checksum("--set", "rdmaForNonHostNetworkPods=false") != base
    assert checksum("--set", "devicePlugin.sharedUnits=500") != base
    assert checksum("--set", f"image.digest={DIGEST}") == base


# --- metrics: the proxy and the ServiceMonitor --------------------------------------------------------

PROXY = ["--set", "metrics.proxy.enabled=true", "--set", f"metrics.proxy.image=quay.io/brancz/kube-rbac-proxy@{DIGEST}"]


def test_the_metrics_proxy_forwards_to_the_daemon_and_may_check_tokens(helm):
    """docs/metrics.md's proxy: the daemon's loopback /metrics behind kube-rbac-proxy on the node's
    address; the pod gets a token only then, and its ServiceAccount only TokenReview and
    SubjectAccessReview."""
    docs = render(helm, *PROXY, "--set", "metrics.port=9555")
    pod = by_kind([d for d in docs if d["kind"] == "DaemonSet"])["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True and pod["serviceAccountName"] == "rdma-netns-dp"
    proxy = next(c for c in pod["containers"] if c["name"] == "kube-rbac-proxy")
    assert "--upstream=http://127.0.0.1:9555/" in proxy["args"] and "--allow-paths=/metrics" in proxy["args"]
    assert "--secure-listen-address=$(NODE_IP):9479" in proxy["args"]
    assert proxy["ports"] == [{"name": "metrics", "containerPort": 9479}]
    assert proxy["securityContext"]["capabilities"] == {"drop": ["ALL"]} and proxy["securityContext"]["runAsUser"] != 0
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-metrics-proxy")]
    assert {(r["apiGroups"][0], r["resources"][0], tuple(r["verbs"])) for r in role["rules"]} == {
        ("authentication.k8s.io", "tokenreviews", ("create",)), ("authorization.k8s.io", "subjectaccessreviews", ("create",))}
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rdma-netns-dp", "namespace": "kube-system"}]
    for version in ("1.29", kubernetes_validate.latest_version()):
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    default = by_kind(render(helm))["DaemonSet"]["spec"]["template"]["spec"]
    assert default["automountServiceAccountToken"] is False and "serviceAccountName" not in default


def test_the_service_monitor_scrapes_the_proxies_of_this_release(helm):
    docs = render(helm, *PROXY, "--set", "metrics.serviceMonitor.enabled=true", "--set", "pool=lag",
                  "-f", str(LAG_VALUES))
    kinds = {d["kind"]: d for d in docs}
    service, monitor, ds = kinds["Service"], kinds["ServiceMonitor"], kinds["DaemonSet"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] == "metrics" and endpoint["scheme"] == "https"
    for doc in (service,):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("args, message", [
    (["--set", "metrics.serviceMonitor.enabled=true"], "metrics.serviceMonitor.enabled needs metrics.proxy.enabled"),
    (["--set", "metrics.proxy.enabled=true"], "metrics.proxy.image: the kube-rbac-proxy image, pinned by digest"),
    ([*PROXY, "--set", "metrics.port=0"], "metrics.proxy.enabled needs metrics.port"),
], ids=["monitor-without-proxy", "proxy-without-image", "proxy-without-metrics"])
def test_a_metrics_setting_that_cannot_work_is_refused_with_its_reason(helm, args, message):
    proc = subprocess.run([helm, "template", "rel", str(CHART), *args], capture_output=True, text=True)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# --- helm test -----------------------------------------------------------------------------------

def helm_test_pod(docs: list[dict]) -> dict:
    pod = by_kind(docs)["Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    return pod


def test_the_helm_test_pod_asks_like_a_training_pod_where_the_release_runs(helm):
    """One rdma/hca on a node of this release (its pool's), the rails' interface names, and no
    privilege at all: Pod Security "restricted" admits it in any namespace."""
    for args, ifnames in ((["--set", "pool=lag", "-f", str(LAG_VALUES)], "rdma0 rdma1 rdma2 rdma3"),
                          (["--set-json", 'rails=[{"netdev": "bond0"}, {"netdev": "bond1", "ifname": "net1"}]'],
                           "rdma0 net1")):
        docs = render(helm, *args)
        pod, ds = helm_test_pod(docs)["spec"], by_kind(docs)["DaemonSet"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == ds["nodeSelector"] and pod.get("affinity") == ds.get("affinity")
        assert pod["tolerations"] == ds["tolerations"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"] == {"rdma/hca": 1}
        assert {e["name"]: e["value"] for e in container["env"]}["RAILS"] == ifnames
        # Pod Security "restricted" (v1.28+): non-root, RuntimeDefault seccomp, no escalation, no capability.
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "hostNetwork" not in pod and not any("hostPath" in v for v in pod.get("volumes", []))
    assert "Pod" not in {d["kind"] for d in render(helm, "--set", "test.enabled=false")}
    assert "Pod" not in {d["kind"] for d in render(helm, "--set", "component=uninstall")}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace with the pod's rails)")
def test_the_helm_test_script_passes_a_wired_pod_and_names_what_is_missing(helm, tmp_path: Path):
    """The test pod's script, run in a network namespace shaped like a granted pod (veth rails with
    a global and a link-local IPv6 address), its /dev/infiniband and /etc/nccl.conf moved under
    tmp_path: it passes, and each thing taken away fails it with its reason."""
    (container,) = helm_test_pod(render(helm, "--set-json", 'rails=[{"netdev": "eth1"}, {"netdev": "eth2"}]'))[
        "spec"]["containers"]
    devices, nccl = tmp_path / "infiniband", tmp_path / "nccl.conf"
    script = container["command"][2].replace("/dev/infiniband", str(devices)).replace("/etc/nccl.conf", str(nccl))
    env = {"PATH": "/usr/bin:/bin", **{e["name"]: e["value"] for e in container["env"]}}
    netns = f"rnh-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)

    def ip(*args: str) -> None:
        subprocess.run(["ip", "-n", netns, *args], check=True, capture_output=True)

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", netns, "/bin/sh", "-c", script], env=env,
                              capture_output=True, text=True, timeout=30)

    def until_ok(rail: str) -> subprocess.CompletedProcess:  # the link-local address leaves DAD first
        for _ in range(100):
            out = check()
            if f"ok   {rail}" in out.stdout:
                return out
            time.sleep(0.05)
        return out

    try:
        for index, rail in enumerate(("rdma0", "rdma1")):
            ip("link", "add", rail, "type", "veth", "peer", "name", f"peer{index}")
            ip("address", "add", f"fd00:10::{index + 2}/64", "dev", rail, "nodad")
            ip("link", "set", f"peer{index}", "up")
            ip("link", "set", rail, "up")
        devices.mkdir()
        (devices / "uverbs0").touch()
        nccl.write_text("NCCL_IB_HCA==rxe0:1,rxe1:1\nNCCL_IB_GID_INDEX=3\n")
        until_ok("rdma1")
        out = until_ok("rdma0")
        assert out.returncode == 0, out.stdout
        assert "ok   /etc/nccl.conf: NCCL_IB_HCA==rxe0:1,rxe1:1 NCCL_IB_GID_INDEX=3" in out.stdout.replace(
            str(nccl), "/etc/nccl.conf")
        ip("address", "flush", "dev", "rdma1", "scope", "link")
        out = check()
        assert out.returncode == 1 and "FAIL rdma1: no link-local IPv6 address" in out.stdout, out.stdout
        ip("address", "flush", "dev", "rdma1", "scope", "global")
        assert "FAIL rdma1: no global IPv6 address" in check().stdout
        ip("link", "delete", "rdma1")
        assert "FAIL rdma1: no such interface in the pod" in check().stdout
        (devices / "uverbs0").unlink()
        nccl.unlink()
        out = check()
        assert f"FAIL {devices}: no uverbs device" in out.stdout, out.stdout
        assert "no NCCL settings (is CDI on in the runtime?" in out.stdout, out.stdout
        assert "ok   rdma0" in out.stdout
    finally:
        subprocess.run(["ip", "netns", "delete", netns], check=False)


# --- the configuration reference --------------------------------------------------------------------

def leaf_values(tree: dict, prefix: str = "") -> dict[str, object]:
    """values.yaml's keys as the reference names them (dotted), down to scalars and lists."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name != "nodeSelector":
            out.update(leaf_values(value, f"{name}."))
        else:
            out[name] = value
    return out


def reference_rows() -> dict[str, str]:
    """docs/configuration.md's "The Helm chart's values" table: each named value -> its default cell."""
    text = (REPO / "docs" / "configuration.md").read_text().split("## The Helm chart's values", 1)[1]
    rows: dict[str, str] = {}
    for line in text.split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = [n.strip().strip("`") for n in cells[0].split(",")]
        defaults = [d.strip() for d in cells[2].split(", ")] if len(names) > 1 else [cells[2]]
        for index, name in enumerate(names):
            rows[name] = defaults[index] if len(defaults) == len(names) else cells[2]
    return rows


def test_the_configuration_reference_names_every_value_with_its_default():
    values = leaf_values(yaml.safe_load((CHART / "values.yaml").read_text()))
    rows = reference_rows()
    assert set(rows) == set(values), (f"in values.yaml only: {sorted(set(values) - set(rows))}; "
                                      f"in docs/configuration.md only: {sorted(set(rows) - set(values))}")
    for name, value in values.items():
        cell = rows[name]
        if isinstance(value, bool):
            assert cell == f"`{str(value).lower()}`", name
        elif isinstance(value, (str, int, float)):
            assert cell == (f"`{value}`" if value != "" else '`""`'), f"{name}: values.yaml {value!r}, docs {cell}"
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            assert cell == f"`[{', '.join(value)}]`", f"{name}: values.yaml {value!r}, docs {cell}"
        elif isinstance(value, list) and not value:
            assert cell == "`[]`", name


def test_helm_test_runs_the_two_pod_rdma_check_when_given_an_image(helm):
    """test.rdmaCheck.image adds conf/k8s/rdma-check.yaml's Service and Job as test hooks (the
    Service first), on the release's nodes; without an image there is nothing to run it with."""
    image = "registry.example.com/ml/perftest:1"
    assert "Job" not in {d["kind"] for d in render(helm)}
    docs = render(helm, "--set", f"test.rdmaCheck.image={image}", "--set", "pool=lag", "-f", str(LAG_VALUES))
    kinds = {d["kind"]: d for d in docs}
    service, job, ds = kinds["Service"], kinds["Job"], kinds["DaemonSet"]
    assert job["metadata"]["name"] == service["metadata"]["name"] == "rdma-check-lag"
    assert job["metadata"]["annotations"]["helm.sh/hook"] == service["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert int(service["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"].get("helm.sh/hook-weight", "0"))
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == ds["spec"]["template"]["spec"]["nodeSelector"]
    assert "nodeAffinity" not in pod["affinity"]  # a pool's nodes carry the pool label
    (check,) = pod["containers"]
    assert check["image"] == image
    plain = [d for d in yaml.safe_load_all((REPO / "conf" / "k8s" / "rdma-check.yaml").read_text()) if d]
    assert [d["kind"] for d in plain] == ["Service", "Job"] and all("annotations" not in d["metadata"] for d in plain)
    (plain_check,) = [d for d in plain if d["kind"] == "Job"][0]["spec"]["template"]["spec"]["containers"]
    assert plain_check["command"] == check["command"]  # one script: files/rdma-check.sh
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)



# --- containerd's CDI setting in the readiness check ---------------------------------------------------

CDI_OFF = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "pause"\n'
CDI_ON = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = true\n'


def test_readiness_problems_name_containerd_with_cdi_off(tmp_path: Path):
    from rdma_netns.admin import cni_conf, cni_conf_ready

    conf_dir, state = tmp_path / "net.d", cni_conf.State(tmp_path / "state")
    conf_dir.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(CDI_OFF)
    (found,) = cni_conf_ready.problems(conf_dir, state, entry=False, node_fit=False, containerd_config=str(config))
    assert "enable_cdi not set (off by default)" in found and "enable_cdi = true" in found, found
    config.write_text(CDI_ON)
    assert cni_conf_ready.problems(conf_dir, state, entry=False, node_fit=False, containerd_config=str(config)) == []
    config.unlink()  # CRI-O or containerd 2.x nodes have no such file: nothing to say
    assert cni_conf_ready.problems(conf_dir, state, entry=False, node_fit=False, containerd_config=str(config)) == []


def test_the_sidecar_is_not_ready_while_containerd_has_cdi_off(helm, tmp_path: Path):
    """runtime.containerdConfigDir: the sidecar mounts that folder and its watch says not ready
    while containerd's config has CDI off (pods would get no NCCL/UCX settings); the chart's probe
    reads the answer. Off by default (the plain manifests do not mount it)."""
    from tests.conftest import installed_executable
    from tests.unit.test_manifests import FileProbe, container

    docs = render(helm, "--set", "runtime.containerdConfigDir=/etc/containerd")
    pod = by_kind(docs)["DaemonSet"]["spec"]["template"]["spec"]
    watch = container(pod, "cni-conf-watch")
    volume = {v["name"]: v for v in pod["volumes"]}["containerd-config"]
    assert volume["hostPath"] == {"path": "/etc/containerd", "type": "Directory"}
    assert {"name": "containerd-config", "mountPath": "/host/containerd", "readOnly": True} in watch["volumeMounts"]
    default = by_kind(render(helm))["DaemonSet"]["spec"]["template"]["spec"]
    assert "containerd-config" not in {v["name"] for v in default["volumes"]}
    host, config, ready = tmp_path / "host", tmp_path / "config", tmp_path / "ready"
    (host / "etc" / "cni" / "net.d").mkdir(parents=True)
    (host / "containerd").mkdir()
    (host / "containerd" / "config.toml").write_text(CDI_OFF)
    config.mkdir()
    for key, value in by_kind(docs)["ConfigMap"]["data"].items():
        (config / key).write_text(value)
    (host / "etc" / "cni" / "net.d" / "10-bridge.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": "pods", "plugins": [{"type": "bridge"}]}))
    probe = FileProbe(watch["readinessProbe"], ready)
    script = (watch["command"][2].replace("/host/", f"{host}/").replace("/etc/rdma-netns/", f"{config}/")
              .replace(probe.file, str(ready)))
    env = {"PATH": f"{os.path.dirname(installed_executable())}:/usr/bin:/bin", "RDMA_FOR_NON_HOSTNETWORK_PODS": "true"}
    proc = subprocess.Popen(["/bin/sh", "-ec", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.05)
        out = probe.run(env)
        assert out.returncode == 1 and "enable_cdi not set (off by default)" in out.stdout, out.stdout
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
