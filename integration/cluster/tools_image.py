"""The training pods' image for the real-cluster suite: what a job's image brings for RDMA (rdma-core's
libibverbs with its Soft-RoCE provider, perftest), nothing of rdma-netns. The seed's Job names "your
training image (CUDA, NCCL, rdma-core)"; this is its RDMA part.

Made like the pause image (integration/cri/pause_image.py), from this machine's Debian files: the
perftest programs with the shared libraries they load (ldd's closure, the loader included), the
rxe provider and its driver file, and busybox-static for the shell and the few tools the tests use.
A few MiB, so that a guest node imports it in seconds. Cached by the files' contents.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from imagebuild import oci
from integration.runtime.podman_rig import static_busybox

CACHE = Path(os.environ.get("RDMA_NETNS_CRI_CACHE", "/var/cache/rdma-netns-cri"))
REPOSITORY = "localhost/rdma-netns-test/rdma-tools"
RECIPE = 1
PROGRAMS = ("/usr/bin/ib_write_bw", "/usr/bin/ib_send_lat")
PROVIDER_GLOBS = ("/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so", "/etc/libibverbs.d/rxe.driver")
APPLETS = ("sh", "sleep", "date", "touch", "sed", "cat", "env", "ls")


@dataclass(frozen=True)
class ToolsImage:
    name: str
    archive: Path


def _closure(paths: list[str]) -> list[str]:
    """The files and every shared library they load (ldd), real paths and the names they go by."""
    found: set[str] = set()
    for path in paths:
        found.add(path)
        if path.endswith(".driver"):
            continue
        for line in subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout.splitlines():
            parts = line.split()
            lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
            if lib.startswith("/"):
                found.add(lib)
    return sorted(found)


def _files() -> list[str]:
    missing = [p for p in PROGRAMS if not os.path.exists(p)]
    providers = [m for g in PROVIDER_GLOBS for m in glob.glob(g)]
    if missing or len(providers) < 2:
        raise FileNotFoundError(f"perftest and ibverbs-providers are needed (missing {missing or PROVIDER_GLOBS})")
    return _closure([*PROGRAMS, *providers])


def _layer(files: list[str], busybox: bytes) -> bytes:
    buf = io.BytesIO()
    folders: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def folder(name: str) -> None:
            parts = name.split("/")
            for i in range(1, len(parts)):
                sub = "/".join(parts[:i])
                if sub not in folders:
                    folders.add(sub)
                    tar.addfile(oci.entry(sub, kind=tarfile.DIRTYPE, mode=0o1777 if sub == "tmp" else 0o755))
        for empty in ("dev/x", "proc/x", "sys/x", "tmp/x", "etc/x", "bin/x"):
            folder(empty)
        for path in files:
            name = path.lstrip("/")
            folder(name)
            data = Path(path).read_bytes()  # through symlinks: the library under the name it is asked by
            tar.addfile(oci.entry(name, size=len(data), mode=0o755), io.BytesIO(data))
        tar.addfile(oci.entry("bin/busybox", size=len(busybox)), io.BytesIO(busybox))
        for applet in APPLETS:
            tar.addfile(oci.entry(f"bin/{applet}", kind=tarfile.SYMTYPE, mode=0o777, link="busybox"))
    return buf.getvalue()


def build() -> ToolsImage:
    busybox_path = static_busybox()
    if busybox_path is None:
        raise FileNotFoundError("no static busybox (apt-get install busybox-static)")
    busybox = Path(busybox_path).read_bytes()
    files = _files()
    digest = hashlib.sha256(f"recipe={RECIPE}\n".encode() + busybox)
    for path in files:
        digest.update(path.encode() + b"\0" + Path(path).read_bytes())
    key = digest.hexdigest()[:16]
    name = f"{REPOSITORY}:{key}"
    archive = CACHE / f"rdma-tools-{key}.oci.tar"
    if archive.exists():
        return ToolsImage(name, archive)
    CACHE.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=CACHE, prefix=".rdma-tools-", suffix=".oci.tar")
    os.close(fd)
    oci.write_archive(Path(tmp), name, [oci.plain_layer(_layer(files, busybox))],
                      {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/"})
    os.replace(tmp, archive)
    return ToolsImage(name, archive)
