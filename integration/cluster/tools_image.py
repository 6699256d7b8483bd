"""The training pods' image for the real-cluster suite: what a job's image brings for RDMA (Debian's
rdma-core providers and perftest), nothing of rdma-netns. The seed's Job names "your training image
(CUDA, NCCL, rdma-core)"; this is its RDMA part. Built from Debian packages with the image build's
own pieces (imagebuild.debian, imagebuild.oci) and cached by recipe."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from imagebuild import debian, oci

CACHE = Path(os.environ.get("RDMA_NETNS_IMAGE_CACHE", "/var/cache/rdma-netns-image"))
RECIPE = debian.Recipe("minbase", ("perftest", "ibverbs-providers", "rdma-core", "iproute2"))
REPOSITORY = "localhost/rdma-netns-test/rdma-tools"


@dataclass(frozen=True)
class ToolsImage:
    name: str
    archive: Path


def build() -> ToolsImage:
    name = f"{REPOSITORY}:{RECIPE.key()}"
    archive = CACHE / f"rdma-tools-{RECIPE.key()}.oci.tar"
    if archive.exists():
        return ToolsImage(name, archive)
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rdma-tools-", dir=CACHE))
    try:
        debian.root(CACHE, RECIPE, work / "root")
        tmp = work / "image.oci.tar"
        oci.write_archive(tmp, name, [oci.tree_layer(work / "root")],
                          {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                           "Cmd": ["/bin/sh"], "WorkingDir": "/"})
        os.replace(tmp, archive)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ToolsImage(name, archive)
