"""`python3 -m imagebuild --release R --name IMAGE --out FILE.oci.tar` (scripts/build-image.sh).

1. Two Debian 12 roots from mmdebstrap (cached as tarballs by recipe): a build root with Debian's
   python3.11 and venv, and the image root (minbase: the shell and coreutils the init script uses).
2. rdma-netns as a wheel of this checkout, its dependencies as manylinux wheels from PyPI
   (pip download; cached).
3. The release folder in the build root (imagebuild/release.py): python3.11 with its library
   closure and loader, a venv with the wheels installed offline.
4. The image root gets the release, /opt/rdma-netns-ds/current and /usr/local/bin links; one layer,
   written as an OCI archive for `ctr images import` and `podman load`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from imagebuild import oci, release

REPO = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
MIRROR = os.environ.get("RDMA_NETNS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BUILD_PACKAGES = ["python3.11-minimal", "libpython3.11-stdlib", "python3.11-venv"]
RECIPE = 1  # bump when the roots' recipe changes (part of their cache key)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]


def log(message: str) -> None:
    print(f"build-image: {message}", file=sys.stderr, flush=True)


def debian_root(cache: Path, packages: list[str], into: Path) -> None:
    """A minbase Debian root with `packages`, from the cache when its recipe was built before."""
    key = hashlib.sha256(json.dumps([RECIPE, SUITE, MIRROR, sorted(packages)]).encode()).hexdigest()[:16]
    tarball = cache / f"root-{SUITE}-{key}.tar"
    if not tarball.exists():
        log(f"mmdebstrap {SUITE} minbase {' '.join(packages) or '(nothing else)'}")
        tmp = cache / f".{tarball.name}.tmp"
        argv = ["mmdebstrap", "--quiet", "--variant=minbase", "--skip=output/dev", "--format=tar"]
        if packages:
            argv.append("--include=" + ",".join(packages))
        subprocess.run([*argv, SUITE, str(tmp), MIRROR], check=True)
        tmp.replace(tarball)
    into.mkdir(parents=True)
    with tarfile.open(tarball) as tar:  # our own mmdebstrap output: device nodes were skipped
        kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        tar.extractall(into, numeric_owner=True, **kw)


def wheels(cache: Path, into: Path) -> None:
    """rdma-netns of this checkout as a wheel, and its dependencies' wheels for CPython 3.11 on
    x86_64 glibc (cached: pip download skips what is there)."""
    into.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    with tempfile.TemporaryDirectory(prefix="rdma-netns-src-") as src:
        shutil.copytree(REPO, src, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
        subprocess.run([*pip, "wheel", "--no-deps", "-w", str(into), src], check=True)
    (ours,) = into.glob("rdma_netns-*.whl")
    deps = cache / "wheels"
    deps.mkdir(exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    # pip download copies our wheel into the cache too, and a later build of the same version
    # would then resolve the dependencies of that stale copy ("already downloaded"): never keep it.
    for stale in deps.glob("rdma_netns-*.whl"):
        stale.unlink()
    subprocess.run([*pip, "download", "-d", str(deps), "--only-binary=:all:", *platforms, "--python-version", "3.11",
                    "--implementation", "cp", str(ours)], check=True)
    for wheel in deps.glob("*.whl"):
        if wheel.name.startswith("rdma_netns-"):
            wheel.unlink()
        else:
            shutil.copy2(wheel, into / wheel.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--release", required=True, help="the release folder's name, unique per build")
    parser.add_argument("--name", required=True, help="the image reference, e.g. localhost/rdma-netns/rdma-netns:R")
    parser.add_argument("--out", required=True, type=Path, help="the OCI archive to write")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("RDMA_NETNS_IMAGE_CACHE",
                                                                          "/var/cache/rdma-netns-image")))
    parser.add_argument("--test-hooks", action="store_true",
                        help="a test build: its plugin honours the test-only variables (the deploy suite)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        log("run as root (mmdebstrap, chroot)")
        return 2
    if "/" in args.release or not args.release or len(args.release) > 40:
        log("--release must be a short name without '/'")
        return 2
    start = time.monotonic()
    args.cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rdma-netns-image-", dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        work = Path(tmp)
        debian_root(args.cache, BUILD_PACKAGES, work / "build-root")
        debian_root(args.cache, [], work / "image-root")
        wheels(args.cache, work / "wheels")
        log(f"release {args.release}: python closure and venv")
        built = release.build(work / "build-root", args.release, work / "wheels", test_hooks=args.test_hooks)
        image_root = work / "image-root"
        target = image_root / Path(release.PREFIX).relative_to("/")
        target.mkdir(parents=True)
        shutil.copytree(built, target / args.release, symlinks=True)
        (target / "current").symlink_to(args.release)
        for tool in ("rdma-netns", "rdma-netns-dp"):
            link = image_root / "usr/local/bin" / tool
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f"{release.PREFIX}/{args.release}/venv/bin/{tool}")
        log("layer and OCI archive")
        layer = oci.tree_layer(image_root)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        manifest = oci.write_archive(
            args.out, args.name, [layer],
            {"Cmd": ["rdma-netns-dp", "--config", "/etc/rdma-netns/dp.yaml"],
             "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"},
            labels={"org.opencontainers.image.title": "rdma-netns",
                    "org.opencontainers.image.version": args.release,
                    "org.opencontainers.image.description": "RDMA for non-hostNetwork pods: device plugin "
                                                            "rdma-netns-dp and CNI plugin rdma-netns"})
        release_bytes = sum(p.stat().st_size for p in built.rglob("*") if p.is_file() and not p.is_symlink())
    print(json.dumps({"image": args.name, "archive": str(args.out), "manifest": manifest,
                      "archiveBytes": args.out.stat().st_size, "layerBytes": len(layer.data),
                      "releaseBytes": release_bytes, "testHooks": args.test_hooks,
                      "seconds": round(time.monotonic() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
