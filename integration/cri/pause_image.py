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
import json
import os
import platform
import tarfile
import tempfile
from dataclasses import dataclass

from integration.runtime.podman_rig import static_busybox  # one finder for both rigs
from pathlib import Path

CACHE_DIR = Path(os.environ.get("RDMA_NETNS_CRI_CACHE", "/var/cache/rdma-netns-cri"))
REPOSITORY = "localhost/rdma-netns/pause"
# Bump when the recipe below changes (it is part of the cache key).
RECIPE = 1
# PID 1 of a pod: no default signal action applies to PID 1, hence the explicit trap.
PAUSE_SCRIPT = b"""#!/bin/sh
# rdma-netns test pause: hold the pod's namespaces until told to stop.
trap 'exit 0' TERM INT
while :; do
  sleep 3600 &
  wait $!
done
"""


def arch() -> str:
    """The OCI architecture name of this machine (ctr import keeps only this platform)."""
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


@dataclass(frozen=True)
class PauseImage:
    name: str      # e.g. localhost/rdma-netns/pause:3f2a...  (the sandbox_image)
    tarball: Path  # OCI image layout, tar
    cached: bool   # True when the tarball was already there


def _entry(name: str, *, kind: bytes = tarfile.REGTYPE, mode: int = 0o755, size: int = 0,
           link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    return info


def _layer(busybox: bytes) -> bytes:
    """The rootfs as an uncompressed tar (media type ...layer.v1.tar)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("bin", "dev", "etc", "proc", "run", "sys", "tmp"):
            tar.addfile(_entry(folder, kind=tarfile.DIRTYPE, mode=0o1777 if folder == "tmp" else 0o755))
        tar.addfile(_entry("bin/busybox", size=len(busybox)), io.BytesIO(busybox))
        for applet in ("sh", "sleep"):
            tar.addfile(_entry(f"bin/{applet}", kind=tarfile.SYMTYPE, mode=0o777, link="busybox"))
        tar.addfile(_entry("pause", size=len(PAUSE_SCRIPT)), io.BytesIO(PAUSE_SCRIPT))
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def _oci_layout(busybox: bytes, name: str) -> bytes:
    """oci-layout + index.json + blobs (layer, config, manifest), as one tar."""
    layer_digest, layer = _blob(_layer(busybox))
    config_digest, config = _blob(json.dumps({
        "architecture": arch(), "os": "linux",
        "config": {"Entrypoint": ["/pause"], "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }, sort_keys=True).encode())
    manifest_digest, manifest = _blob(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}],
    }, sort_keys=True).encode())
    index = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": len(manifest),
                       "platform": {"architecture": arch(), "os": "linux"},
                       "annotations": {"org.opencontainers.image.ref.name": name}}],
    }, sort_keys=True).encode()
    files = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)]
    files += [(f"blobs/sha256/{d.split(':')[1]}", data)
              for d, data in sorted([(layer_digest, layer), (config_digest, config), (manifest_digest, manifest)])]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("blobs", "blobs/sha256"):
            tar.addfile(_entry(folder, kind=tarfile.DIRTYPE))
        for path, data in files:
            tar.addfile(_entry(path, mode=0o644, size=len(data)), io.BytesIO(data))
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
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".pause-", suffix=".tmp")
    with os.fdopen(fd, "wb") as out:
        out.write(_oci_layout(busybox, name))
    os.replace(tmp, tarball)  # atomic: concurrent builders write the same bytes
    return PauseImage(name, tarball, cached=False)
