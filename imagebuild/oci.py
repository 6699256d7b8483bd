"""An OCI image layout, as one tar archive that `ctr images import` and `podman load` take.

Deterministic: sorted entries, fixed times and owners in what this module writes, so an image's
digest depends only on its layers' bytes and config.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from pathlib import Path

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def arch() -> str:
    """The OCI architecture name of this machine (ctr import keeps only this platform)."""
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def entry(name: str, *, kind: bytes = tarfile.REGTYPE, mode: int = 0o755, size: int = 0,
          link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    return info


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layer:
    """One layer blob: `data` as stored, `diff_id` the digest of its uncompressed tar."""

    def __init__(self, data: bytes, media_type: str, diff_id: str) -> None:
        self.data, self.media_type, self.diff_id = data, media_type, diff_id


def plain_layer(tar_bytes: bytes) -> Layer:
    return Layer(tar_bytes, LAYER_TAR, digest(tar_bytes))


def write_archive(out: Path, name: str, layers: list[Layer], config: dict, labels: dict | None = None,
                  created: str | None = None) -> str:
    """Write the image `name` (repository:tag) as an OCI layout tar; returns the manifest digest.

    config: the image config's "config" part (Entrypoint, Cmd, Env, WorkingDir, ...). labels go
    into the config (what `docker/podman inspect` and `crictl inspecti` show) and, as annotations,
    into the manifest (what registries and `skopeo inspect --raw` show); created (RFC 3339) is the
    config's "created"."""
    image_config = dict(config)
    if labels:
        image_config["Labels"] = labels
    document = {"architecture": arch(), "os": "linux", "config": image_config,
                "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]}}
    if created:
        document["created"] = created
    config_blob = json.dumps(document, sort_keys=True).encode()
    manifest_document = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": digest(config_blob), "size": len(config_blob)},
        "layers": [{"mediaType": layer.media_type, "digest": digest(layer.data), "size": len(layer.data)}
                   for layer in layers],
    }
    if labels:
        manifest_document["annotations"] = labels
    manifest = json.dumps(manifest_document, sort_keys=True).encode()
    index = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": digest(manifest), "size": len(manifest),
                       "platform": {"architecture": arch(), "os": "linux"},
                       "annotations": {"org.opencontainers.image.ref.name": name}}],
    }, sort_keys=True).encode()
    blobs = {digest(b): b for b in [config_blob, manifest, *(layer.data for layer in layers)]}
    tmp = out.with_name(f".{out.name}.tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("blobs", "blobs/sha256"):
            tar.addfile(entry(folder, kind=tarfile.DIRTYPE))
        for path, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
                           *sorted((f"blobs/sha256/{d.split(':')[1]}", b) for d, b in blobs.items())]:
            tar.addfile(entry(path, mode=0o644, size=len(data)), io.BytesIO(data))
    tmp.replace(out)
    return digest(manifest)


def tree_layer(root: Path, skip_contents: tuple[str, ...] = ("dev", "proc", "sys", "run", "tmp"),
               mtime: int = 0) -> Layer:
    """A layer of everything under `root` (a root filesystem), owners and modes kept, times set to
    `mtime`; the folders in skip_contents are kept empty (the runtime mounts them)."""
    buf = io.BytesIO()

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        top, _, rest = info.name.partition("/")
        if top in skip_contents and rest:
            return None
        if info.type in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE):
            return None
        info.mtime = mtime
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(p.name for p in root.iterdir()):
            tar.add(root / name, arcname=name, recursive=True, filter=clean)
    return plain_layer(buf.getvalue())
