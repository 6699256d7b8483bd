"""A pause image for containerd's CRI without any registry: Debian's busybox-static, made into an
OCI image layout tarball by hand and imported with `ctr images import`.

The image holds /bin/busybox, /bin/sh (a symlink to it) and /pause, a shell script that sleeps
until SIGTERM/SIGINT. Everything in the tarball is deterministic (mtime 0, owner root, sorted
entries), so its digest depends only on busybox's bytes and this file's recipe; the tarball is
cached under /var/cache/rdma-netns-cri/ by that key and rebuilt only when either changes.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from imagebuild import oci  # the one OCI archive writer (the DaemonSet's image uses it too)
from integration.runtime.podman_rig import static_busybox  # one finder for both rigs

CACHE_DIR = Path(os.environ.get("RDMA_NETNS_CRI_CACHE", "/var/cache/rdma-netns-cri"))
REPOSITORY = "localhost/rdma-netns/pause"
# Bump when the recipe below changes (it is part of the cache key).
RECIPE = 2  # 2: written by imagebuild.oci
# PID 1 of a pod: no default signal action applies to PID 1, hence the explicit trap.
PAUSE_SCRIPT = b"""#!/bin/sh
# rdma-netns test pause: hold the pod's namespaces until told to stop.
trap 'exit 0' TERM INT
while :; do
  sleep 3600 &
  wait $!
done
"""


@dataclass(frozen=True)
class PauseImage:
    name: str      # e.g. localhost/rdma-netns/pause:3f2a...  (the sandbox_image)
    tarball: Path  # OCI image layout, tar
    cached: bool   # True when the tarball was already there


def _layer(busybox: bytes) -> bytes:
    """The rootfs as an uncompressed tar (media type ...layer.v1.tar)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("bin", "dev", "etc", "proc", "run", "sys", "tmp"):
            tar.addfile(oci.entry(folder, kind=tarfile.DIRTYPE, mode=0o1777 if folder == "tmp" else 0o755))
        tar.addfile(oci.entry("bin/busybox", size=len(busybox)), io.BytesIO(busybox))
        for applet in ("sh", "sleep"):
            tar.addfile(oci.entry(f"bin/{applet}", kind=tarfile.SYMTYPE, mode=0o777, link="busybox"))
        tar.addfile(oci.entry("pause", size=len(PAUSE_SCRIPT)), io.BytesIO(PAUSE_SCRIPT))
    return buf.getvalue()


def build(cache_dir: Path = CACHE_DIR) -> PauseImage:
    """The pause image tarball, from the cache when busybox and the recipe are unchanged."""
    busybox_path = static_busybox()
    if busybox_path is None:
        raise FileNotFoundError("no static busybox (apt-get install busybox-static)")
    busybox = Path(busybox_path).read_bytes()
    key = hashlib.sha256(b"recipe=%d\n" % RECIPE + PAUSE_SCRIPT + hashlib.sha256(busybox).digest()).hexdigest()[:16]
    name = f"{REPOSITORY}:{key}"
    tarball = cache_dir / f"pause-{key}.oci.tar"
    if tarball.exists():
        return PauseImage(name, tarball, cached=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".pause-", suffix=".oci.tar")
    os.close(fd)
    oci.write_archive(Path(tmp), name, [oci.plain_layer(_layer(busybox))],
                      {"Entrypoint": ["/pause"], "Env": ["PATH=/bin"], "WorkingDir": "/"})
    os.replace(tmp, tarball)  # atomic: concurrent builders write the same bytes
    return PauseImage(name, tarball, cached=False)
