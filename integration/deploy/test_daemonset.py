"""The add-on as an admin installs it (issue 22): conf/k8s/rdma-netns-dp-daemonset.yaml with the
image scripts/build-image.sh built, run the way kubelet runs it through containerd 1.7's CRI
(rig.py says what is as written and what is mapped), then the pods the walk-through of docs/install.md
creates, a rolling update under load, and the uninstall.

The tests run in order on one node (module fixture) and each leaves the node as the next expects:
installed with image A; B after the rolling update; nothing after the uninstall.
"""

from __future__ import annotations

import io
import json
import shutil
import statistics
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from integration.cri.rig import in_subnet
from integration.deploy.conftest import REPORT
from integration.deploy.kubelet import RunningPod
from integration.deploy.rig import DeployNode, bare_root_call, node_address

pytestmark = pytest.mark.cri

RESOURCE = "rdma/hca"
STATE: dict = {}  # what one test leaves the next: the DaemonSet pod, timings


def pod_name(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:6]}"


def install(node: DeployNode, image) -> RunningPod:
    """The DaemonSet's pod on the node: sandbox (hostNetwork), install-cni to completion, the device
    plugin and the watcher, Ready by the manifest's own readiness probe."""
    spec = node.daemonset_spec(image.pinned)  # by digest, as docs/install.md says to
    return node.kubelet_driver.run(spec, pod_name("rdma-netns-dp"), "kube-system", ready_timeout=120)


def rails_of(node: DeployNode, pod: RunningPod) -> dict[str, list[str]]:
    return {name: a["inet6"] for name, a in node.interfaces(pod).items() if name.startswith("rdma")}


def test_install_the_daemonset_registers_the_plugin_and_chains_the_entry(node, images):
    started = time.monotonic()
    ds = install(node, images["a"])
    STATE["ds"] = ds
    assert ds.init_exit == {"kernel-mode": 0, "install-cni": 0}
    assert node.launcher_release() == images["a"].release, "the launcher runs image A's release from the host"
    registered = node.kubelet.wait_registrations(1, 30)
    assert registered[-1].request.resource_name == RESOURCE
    plugin = node.kubelet.plugin(RESOURCE, timeout=30)
    try:
        update = plugin.wait_for(lambda u: sum(h == "Healthy" for h in u.health().values()) == 1000, 30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\ndevice plugin's log:\n{node.kubelet_driver.logs(ds, 'rdma-netns-dp')[-3000:]}")
    assert len(update.ids()) == 1000
    assert node.chained(), "the entry is last in the primary conflist"
    entry = json.loads(node.primary_path.read_text())["plugins"][-1]
    assert entry["resourceName"] == RESOURCE and entry["rangeFromNodeAddress"]["prefixLength"] == 112
    node.rig.wait_network_loaded(node.primary.name)
    release = Path("/opt/rdma-netns-ds") / images["a"].release
    size = sum(p.stat().st_size for p in release.rglob("*") if p.is_file() and not p.is_symlink())
    REPORT.append(f"DaemonSet pod (image A) Ready {ds.ready_after:.1f} s after RunPodSandbox "
                  f"({time.monotonic() - started:.1f} s with admission); on the host: {release} "
                  f"{size / 2**20:.0f} MiB + the launcher")


def capabilities(status: str) -> dict[str, int]:
    found = {}
    for line in status.splitlines():
        key, _, value = line.partition(":\t")
        if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            found[key] = int(value, 16)
    return found


def test_the_daemon_runs_without_capabilities_and_the_kernel_mode_step_ran_before_it(node):
    """Least privilege (issue 36): the kernel's RDMA netns mode was checked by the init container
    `kernel-mode` (NET_ADMIN), and the long-running daemon, registered and healthy above, holds no
    capability at all, nor can gain one."""
    ds = STATE["ds"]
    log = node.kubelet_driver.logs(ds, "kernel-mode")
    assert "kernel RDMA netns mode is as needed" in log, log[-2000:]
    # The pod's processes share one PID namespace (PID 1 is the sandbox's pause): find the daemon.
    find = ('for d in /proc/[0-9]*; do case "$(tr "\\0" " " < "$d/cmdline" 2>/dev/null)" in '
            '*rdma-netns-d[p]*--confi[g]*) cat "$d/status"; tr "\\0" " " < "$d/cmdline";; esac; done')
    reply = node.kubelet_driver.exec(ds, "rdma-netns-dp", ["/bin/sh", "-c", find])
    assert reply.exit_code == 0, reply.stderr
    status = reply.stdout.decode()
    assert status.count("Name:") == 1 and "--no-ensure-kernel-mode" in status, status
    assert capabilities(status) == dict.fromkeys(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), 0), status
    assert "NoNewPrivs:\t1" in status
    assert node.kubelet_driver.probe(ds, "rdma-netns-dp", "readinessProbe")


def test_the_image_carries_its_sbom_lock_and_dates(images):
    """imagebuild's supply chain, read from the archive that was deployed: the SBOM in the image is
    the one next to the archive and names every Debian package of the image, every Python
    distribution of the release with the lock's hashes, and the release's interpreter and
    libraries; the labels date the Debian packages; nothing the containers do not use is left."""
    import tarfile

    from imagebuild import lock

    facts = images["a"].facts
    with tarfile.open(images["a"].archive) as oci:
        def blob(digest: str) -> bytes:
            return oci.extractfile(f"blobs/sha256/{digest.split(':')[1]}").read()

        index = json.loads(oci.extractfile("index.json").read())
        assert index["manifests"][0]["digest"] == facts["digest"]
        manifest = json.loads(blob(facts["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        labels = config["config"]["Labels"]
        assert manifest["annotations"] == labels
        assert labels["org.opencontainers.image.created"] == config["created"]
        assert labels["io.rdma-netns.debian.date"] == facts["debianDate"] and "security" in labels["io.rdma-netns.debian.suites"]
        names: dict[str, bytes] = {}
        dpkg_status = ""
        with tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][0]["digest"]))) as layer:
            members = layer.getnames()
            files = [m.name for m in layer.getmembers() if m.isfile()]
            in_image = layer.extractfile(labels["io.rdma-netns.sbom"].lstrip("/")).read()
            dpkg_status = layer.extractfile("var/lib/dpkg/status").read().decode()
    assert in_image == Path(facts["sbom"]).read_bytes(), "the SBOM next to the archive is the image's"
    sbom = json.loads(in_image)
    assert sbom["bomFormat"] == "CycloneDX"
    components = {c["name"]: c for c in sbom["components"]}
    installed = {line.split(": ", 1)[1] for line in dpkg_status.splitlines() if line.startswith("Package: ")}
    assert installed <= set(components), installed - set(components)
    release = f"opt/rdma-netns-ds/{images['a'].release}"
    dists = {lock.normalize(m.split("/")[-1].removesuffix(".dist-info").rsplit("-", 1)[0]) for m in members
             if m.startswith(f"{release}/venv/") and m.endswith(".dist-info")}
    purls = {c["purl"].split("@")[0].removeprefix("pkg:pypi/") for c in sbom["components"] if c.get("purl", "").startswith("pkg:pypi/")}
    assert dists and dists <= purls, dists - purls
    hashes = {h["content"] for c in sbom["components"] for h in c.get("hashes", [])}
    assert all(set(e.hashes) & hashes for e in lock.read()), "every locked wheel's hash is in the SBOM"
    assert f"/{release}/python/bin/python3.11" in components and f"/{release}/python/lib/libc.so.6" in components
    assert "python3.11-minimal" in components and "libc6" in components
    unused = [m for m in files if m.startswith(("usr/bin/apt", "usr/bin/perl", "usr/share/man/", "usr/share/locale/"))
              or (m.startswith("usr/share/doc/") and m.count("/") > 3 and not m.endswith("/copyright"))
              or "libsqlite3" in m or "libdb-" in m]
    assert not unused, unused[:20]
    REPORT.append(f"image a: {len(installed)} Debian packages in its root, SBOM {len(sbom['components'])} "
                  f"components; Debian packages as of {facts['debianDate']}")


def test_what_the_init_container_left_runs_on_a_host_with_nothing_but_a_kernel(node, images, tmp_path):
    """A root holding only the copied release and the launcher: VERSION with nothing else at all.
    Then, for ADD and DEL, the host's own IPAM plugin joins it (Debian's host-local, with the libc
    and loader it links: Debian builds it dynamically, upstream's releases are static): a pod's
    rails with no Python, no shell and no libc of the host's for rdma-netns itself."""
    root = Path(f"/var/tmp/rdeploy-bare-{uuid.uuid4().hex[:6]}")
    try:
        (root / "opt/cni/bin").mkdir(parents=True)
        shutil.copytree(Path("/opt/rdma-netns-ds") / images["a"].release,
                        root / "opt/rdma-netns-ds" / images["a"].release, symlinks=True)
        shutil.copy2(node.rig.cni_bin / "rdma-netns", root / "opt/cni/bin/rdma-netns")
        for folder in ("proc", "sys", "var/run/netns", "tmp"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        (root / "var/run/netns/pod").touch()
        listing = sorted(str(p.relative_to(root)) for p in root.iterdir())
        assert listing == ["opt", "proc", "sys", "tmp", "var"]
        version = bare_root_call(root, "VERSION", {"cniVersion": "1.0.0"}, "", "x", "eth0")
        assert version.returncode == 0, version.stderr.decode(errors="replace")
        assert "1.1.0" in json.loads(version.stdout)["supportedVersions"]
        host_local = Path(node.rig.cni_bin / "host-local").resolve()
        shutil.copy2(host_local, root / "opt/cni/bin/host-local")
        for lib in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"):  # host-local's, not ours
            (root / lib.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(lib).resolve(), root / lib.lstrip("/"))
        pod = f"rdeploy-bare-{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", pod], check=True)
        try:
            conf = {"cniVersion": "1.0.0", "name": "bare", "type": "rdma-netns", "mode": "shared",
                    "requireRdma": False, "pairing": False, "stateDir": "/var/lib/cni/rdma-netns", "podInfoDir": "",
                    "ipam": {"type": "host-local", "dataDir": "/var/lib/cni/networks"},
                    "rangeFromNodeAddress": {"prefixLength": 112},
                    "rails": [{"netdev": node.rig.rails[0], "ifname": "rdma0"}]}
            netns = f"/var/run/netns/{pod}"
            added = bare_root_call(root, "ADD", conf, netns, "bare1", "rdma0")
            assert added.returncode == 0, (added.stdout + added.stderr).decode(errors="replace")
            result = json.loads(added.stdout)
            assert result["ips"][0]["address"] == f"fd00:10::7:2/64", result
            inside = subprocess.run(["ip", "-n", pod, "-j", "addr", "show", "rdma0"], capture_output=True,
                                    text=True, check=True).stdout
            assert "fd00:10::7:2" in inside
            deleted = bare_root_call(root, "DEL", conf, netns, "bare1", "rdma0")
            assert deleted.returncode == 0, (deleted.stdout + deleted.stderr).decode(errors="replace")
            assert not list((root / "var/lib/cni/networks/bare").glob("fd00*")), "the lease is released"
        finally:
            subprocess.run(["ip", "netns", "del", pod], check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_training_pod_gets_eth0_and_rails_and_through_cdi_its_settings(node, images):
    spec = node.training_spec(images["a"].name)
    name = pod_name("wdl-train")
    pod = node.kubelet_driver.run(spec, name, "team-a", ready_timeout=60)
    try:
        addresses = node.interfaces(pod)
        assert set(addresses) == {"eth0", "rdma0", "rdma1"}, addresses
        assert any(in_subnet(a, node.primary.subnet4) for a in addresses["eth0"]["inet"]), "eth0 from the cluster CNI"
        for rail in (0, 1):
            (address,) = addresses[f"rdma{rail}"]["inet6"]
            assert address == f"fd00:1{rail}::7:2/64", f"the node's range on rail {rail} ({node_address(rail)})"
        grants = node.kubelet.pod_grants("team-a", name)["train"][RESOURCE]
        env = node.kubelet_driver.exec(pod, "train", ["/bin/sh", "-c", "env; echo ---; cat /etc/rdma-netns/rails.json; "
                                                      "echo ---; ls /dev/infiniband; echo ---; cat /etc/nccl.conf"])
        assert env.exit_code == 0, env.stderr
        out = env.stdout.decode()
        variables, rails_json, devices, nccl = out.split("---\n")
        assert "UCX_NET_DEVICES=rxe0:1,rxe1:1" in variables.splitlines()
        assert "UCX_IB_GID_INDEX=1" in variables.splitlines(), "the pod's own GID index (its address's entry)"
        published = json.loads(rails_json)
        assert [r["ifname"] for r in published["rails"]] == ["rdma0", "rdma1"]
        assert {"uverbs0", "uverbs1", "rdma_cm"} <= set(devices.split())
        # NCCL's settings in /etc/nccl.conf (NCCL applies it without overriding the pod spec's env)
        assert "NCCL_IB_HCA=" in nccl and "rxe0" in nccl and "NCCL_IB_GID_INDEX=1" in nccl, nccl
        REPORT.append(f"training pod: unit {grants}, CDI device rdma-netns.io/pod={grants[0]} resolved by containerd "
                      f"1.7: NCCL/UCX env, rails.json, {sorted(devices.split())}")
        # The DaemonSet's /metrics saw the ADD that containerd ran on the host (its event through
        # /run/rdma-netns/cni-events) and counts the pod on both rails and its unit as allocated.
        # Pods per rail and allocated units come from the daemon's background sample (every
        # metrics.refreshSeconds, 10 s: a scrape never reads state files or asks kubelet).
        metrics = scrape_until(node, lambda m: all(metric(m, f'rdma_netns_rail_pods{{netdev="{rail}"}}', 0) == 1
                                                   for rail in node.rig.rails), 30)
        assert metric(metrics, 'rdma_netns_cni_calls_total{command="ADD",code="0"}') >= 1, metrics[-3000:]
        assert metric(metrics, 'rdma_netns_cni_pairing_total{outcome="granted",via="broker"}') >= 1
        assert metric(metrics, 'rdma_netns_units_allocated{resource="rdma/hca"}') >= 1
        assert metric(metrics, 'rdma_netns_registered{resource="rdma/hca"}') == 1
    finally:
        node.kubelet_driver.stop(pod, grace=2)
    assert not list(Path("/var/lib/cni/rdma-netns").glob("*/*:*.json")), "DEL left an attachment record"


def scrape(node) -> str:
    """The device plugin's /metrics, fetched from inside its container (the manifest's port) by the
    image's own Python (the interpreter rdma-netns-dp's first line names)."""
    fetch = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9478/metrics', timeout=5).read().decode())"
    reply = node.kubelet_driver.exec(STATE["ds"], "rdma-netns-dp",
                                     ["/bin/sh", "-c", 'exec $(sed -n "1s/^#!//p" "$(command -v rdma-netns-dp)") -c "$0"',
                                      fetch])
    assert reply.exit_code == 0, reply.stderr.decode()
    return reply.stdout.decode()


def scrape_until(node, ready, timeout: float) -> str:
    """Scrape until `ready(exposition)` holds (the background sample caught up); the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(node)
        if ready(metrics):
            return metrics
        assert time.monotonic() < deadline, f"/metrics not caught up after {timeout:.0f} s: {metrics[-3000:]}"
        time.sleep(1)


def metric(exposition: str, series: str, missing: float | None = None) -> float:
    """One series' value in an exposition (labels in the order the daemon writes them); `missing`
    when it is not there, if given."""
    name, _, labels = series.partition("{")
    wanted = set(labels.rstrip("}").split(",")) if labels else set()
    for line in exposition.splitlines():
        head, _, value = line.rpartition(" ")
        line_name, _, line_labels = head.partition("{")
        if line_name == name and set(filter(None, line_labels.rstrip("}").split(","))) == wanted:
            return float(value)
    if missing is not None:
        return missing
    raise AssertionError(f"{series} not in the scrape")


def test_sandbox_times_with_and_without_rails(node, images):
    """RunPodSandbox (the CNI ADDs: the cluster CNI's, then rdma-netns) and Stop+Remove (the DELs),
    for pods granted rdma/hca (two rails, GID wait, the published file and CDI spec) and pods not
    granted (rdma-netns passes the result through), alternately."""
    times: dict[str, list[float]] = {"granted ADD": [], "granted DEL": [], "not granted ADD": [], "not granted DEL": []}
    for _ in range(5):
        for label, spec in (("granted", node.training_spec(images["a"].name)), ("not granted", node.plain_spec(images["a"].name))):
            pod = node.kubelet_driver.run(spec, pod_name("timed"), "team-c", ready_timeout=60)
            node.kubelet_driver.stop(pod, grace=1)
            times[f"{label} ADD"].append(pod.sandbox_seconds)
            times[f"{label} DEL"].append(pod.teardown_seconds)
    for kind, values in times.items():
        REPORT.append(f"containerd 1.7, RunPodSandbox/Stop+Remove, {kind}: median {statistics.median(values) * 1000:.0f} ms "
                      f"(min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f}, n={len(values)})")


def test_the_watcher_puts_the_entry_back_when_the_cluster_cni_rewrites_its_conflist(node):
    rewritten = json.loads(node.primary_bytes)
    rewritten["plugins"][0]["isGateway"] = False  # the cluster CNI writes its own file again
    tmp = node.rig.net_dir / ".10-rcri.conflist.tmp"
    tmp.write_text(json.dumps(rewritten, indent=2) + "\n")
    tmp.replace(node.primary_path)
    assert not node.chained()
    seconds = node.wait_for("the entry back in the rewritten conflist", node.chained, 15)
    REPORT.append(f"watcher: entry back {seconds:.1f} s after the cluster CNI rewrote its conflist")
    node.primary_path.write_bytes(node.primary_bytes)  # as before, for the uninstall's byte-for-byte check
    node.wait_for("the entry back", node.chained, 15)


def test_rolling_update_from_a_to_b_leaves_no_pod_without_rails(node, images):
    """RollingUpdate with one node: the old pod terminated, then the new one started, while pods
    granted rdma/hca are created one after another. A pod whose sandbox fails is retried, as kubelet
    does; none may start without its rails, none may fail for good."""
    stop = threading.Event()
    outcomes: list[dict] = []
    retries: list[str] = []  # why a pod had to wait: admission while no device plugin serves, never rails

    def create_pods() -> None:
        while not stop.is_set():
            name = pod_name("loop")
            tries, seen = 0, None
            while tries < 60:  # kubelet keeps a pod it cannot admit or start pending, and retries
                tries += 1
                try:
                    pod = node.kubelet_driver.run(node.training_spec(images["a"].name), name, "team-b", ready_timeout=60)
                except Exception as exc:  # noqa: BLE001 - kubelet keeps the pod and retries
                    seen = str(exc)[:300]
                    retries.append(seen)
                    node.kubelet.forget_pod("team-b", name)
                    time.sleep(1)
                    continue
                try:
                    seen = sorted(rails_of(node, pod))
                finally:
                    node.kubelet_driver.stop(pod, grace=1)
                break
            outcomes.append({"pod": name, "tries": tries, "rails": seen})

    worker = threading.Thread(target=create_pods)
    worker.start()
    try:
        time.sleep(3)
        old = STATE.pop("ds")
        gap_start = time.monotonic()
        node.kubelet_driver.stop(old)  # SIGTERM, the manifest's grace period
        new = install(node, images["b"])
        STATE["ds"] = new
        gap = time.monotonic() - gap_start
        assert node.launcher_release() == images["b"].release
        time.sleep(5)
    finally:
        stop.set()
        worker.join(timeout=300)
    with_rails = [o for o in outcomes if o["rails"] == ["rdma0", "rdma1"]]
    assert outcomes and len(with_rails) == len(outcomes), f"pods without rails: {[o for o in outcomes if o not in with_rails]}"
    retried = [o for o in outcomes if o["tries"] > 1]
    assert not [r for r in retries if "failed to setup network" in r], f"a sandbox's network failed: {retries}"
    releases = sorted(p.name for p in Path("/opt/rdma-netns-ds").iterdir())
    assert images["a"].release in releases and images["b"].release in releases, "the previous release stays"
    REPORT.append(f"rolling update A -> B: old pod out and new pod Ready in {gap:.1f} s; {len(outcomes)} pods "
                  f"created meanwhile, {len(with_rails)} with both rails, {len(retried)} waited to be admitted "
                  f"({'; '.join(sorted(set(r[:120] for r in retries))) or 'none'})")


def test_uninstall_leaves_the_node_as_it_was(node, images):
    pod = STATE.pop("ds")
    node.kubelet_driver.stop(pod)
    assert node.chained(), "the entry outlives the DaemonSet's pod, and so does the executable it names"
    assert (node.rig.cni_bin / "rdma-netns").exists()
    spec = node.daemonset_spec(images["b"].pinned, "rdma-netns-uninstall.yaml")
    cleaner = node.kubelet_driver.run(spec, pod_name("rdma-netns-uninstall"), "kube-system", ready_timeout=60)
    try:
        assert cleaner.init_exit == {"uninstall-node": 0}, node.kubelet_driver.logs(cleaner, "uninstall-node")
        assert node.leftovers() == []
        assert node.primary_path.read_bytes() == node.primary_bytes
    finally:
        node.kubelet_driver.stop(cleaner, grace=2)
    REPORT.append("uninstall: the primary conflist byte for byte as the cluster CNI wrote it, nothing of rdma-netns "
                  "left (releases, launcher, state, sockets, CDI specs)")
