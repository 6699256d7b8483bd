"""The shipped manifests as an admin edits them for the local cluster: the image name (pinned by
digest) and the rails' netdev names, nothing else; and the seed's Job for this machine."""

from __future__ import annotations

import copy
import json

import yaml

from integration.cluster.host_rdma import RAILS, rail_netdev
from integration.cluster.layout import REPO

K8S = REPO / "conf" / "k8s"
CAPABILITY_BITS = {"IPC_LOCK": 14, "SYS_RESOURCE": 24}


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _rails(entry: dict) -> None:
    entry["rails"] = [{"netdev": rail_netdev(r), "ifname": f"rdma{r}"} for r in range(RAILS)]


def daemonset(image: str, entry_changes: dict | None = None) -> str:
    """conf/k8s/rdma-netns-dp-daemonset.yaml with the image and the rails of this cluster's nodes.
    entry_changes: keys of the chained entry an admin edits (a configuration change)."""
    docs = documents("rdma-netns-dp-daemonset.yaml")
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            entry = json.loads(doc["data"]["rdma-netns-chained-entry.json"])
            _rails(entry)
            entry.update(entry_changes or {})
            doc["data"]["rdma-netns-chained-entry.json"] = json.dumps(entry, indent=2) + "\n"
        if doc["kind"] == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                container["image"] = image
    return yaml.safe_dump_all(docs)


def uninstall(image: str) -> str:
    docs = documents("rdma-netns-uninstall.yaml")
    for doc in docs:
        if doc["kind"] == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                container["image"] = image
    return yaml.safe_dump_all(docs)


def has_capability(name: str) -> bool:
    """Is the capability in this machine's bounding set (runc cannot give a container more)?"""
    with open("/proc/self/status") as status:
        bounding = int(next(line for line in status if line.startswith("CapBnd:")).split()[1], 16)
    return bool(bounding >> CAPABILITY_BITS[name] & 1)


def training_job(image: str, name: str, script: str, pods: int = 2, host_network: bool = False,
                 machine_caps_only: bool = True) -> dict:
    """conf/k8s/training-job.yaml's Job: `pods` pods, on one node; the image ours, a shell script instead of
    torchrun; no GPUs and only rdma/hca in resources (this machine has 2 CPUs, no GPU plugin); the
    data volume an emptyDir (no PVCs); capabilities this machine's bounding set lacks left out
    (runc cannot grant them) unless machine_caps_only is False (admission-only checks)."""
    (job,) = [d for d in documents("training-job.yaml") if d["kind"] == "Job"]
    job = copy.deepcopy(job)
    job["metadata"]["name"] = name
    job["spec"].update(parallelism=pods, completions=pods, ttlSecondsAfterFinished=None)
    job["spec"].pop("ttlSecondsAfterFinished")
    spec = job["spec"]["template"]["spec"]
    spec.pop("affinity")  # one pod per node: these tests place a Job's pods on one node
    (train,) = spec["containers"]
    train.update(image=image, command=["/bin/sh", "-c", script])
    train.pop("args", None)
    for what in ("limits", "requests"):
        train["resources"][what] = {k: v for k, v in train["resources"][what].items() if k.startswith("rdma/")}
        if not train["resources"][what]:
            del train["resources"][what]
    spec["volumes"] = [v if "persistentVolumeClaim" not in v else {"name": v["name"], "emptyDir": {}}
                       for v in spec["volumes"]]
    if machine_caps_only:
        caps = train["securityContext"]["capabilities"]
        caps["add"] = [c for c in caps["add"] if has_capability(c)]
    if host_network:
        spec["hostNetwork"] = True
    return job


def pod_of(job: dict, name: str, namespace: str) -> dict:
    """The Job's pod template as a bare Pod (admission checks it the same way)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": copy.deepcopy(job["spec"]["template"]["spec"])}
