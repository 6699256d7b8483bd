"""`python3 -m imagebuild --release R --name IMAGE --out FILE.oci.tar` (scripts/build-image.sh).

1. Two Debian 12 roots from mmdebstrap (imagebuild/debian.py; cached as tarballs by recipe for at
   most RDMA_NETNS_DEBIAN_MAX_AGE_DAYS, then fetched again): a build root with Debian's python3.11
   and venv, and the image root: only what the containers' shell scripts run (below), no apt, no
   documentation but the copyright files.
2. rdma-netns as a wheel of this checkout; its dependencies exactly as imagebuild/requirements.lock
   pins them (pip download --require-hashes; cached).
3. The release folder in the build root (imagebuild/release.py): python3.11 with its library
   closure and loader, a venv with the wheels installed offline (--require-hashes).
4. The image root gets the release, /opt/rdma-netns-ds/current and /usr/local/bin links and the
   SBOM (imagebuild/sbom.py); one layer, written as an OCI archive for `ctr images import` and
   `podman load`, with the SBOM next to it. The summary (last line, JSON) carries the image's
   digest: pin the image by it (docs/install.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from imagebuild import debian, lock, oci, release, sbom

REPO = Path(__file__).resolve().parent.parent
BUILD_ROOT = debian.Recipe("minbase", ("python3.11-minimal", "libpython3.11-stdlib", "python3.11-venv"))
# What the image root holds: the DaemonSet's scripts run /bin/sh (dash) with cat, cp, mkdir, mv,
# readlink, rm, sleep (coreutils) and sed; base-files (os-release, which scanners read) and
# base-passwd (uid 0's name); dpkg (and what it needs to install: diffutils, libc-bin's ldconfig)
# keeps /var/lib/dpkg/status true to the files. Python and its libraries come with the release.
IMAGE_ROOT = debian.Recipe(
    "custom", ("base-files", "base-passwd", "dash", "coreutils", "sed", "dpkg", "diffutils", "libc-bin"),
    ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/locale/*", "path-exclude=/usr/share/info/*",
     "path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright"))


def log(message: str) -> None:
    print(f"build-image: {message}", file=sys.stderr, flush=True)


def wheels(cache: Path, into: Path) -> dict[str, str]:
    """rdma-netns of this checkout as a wheel, and the locked dependencies' wheels (downloaded
    with --require-hashes into the cache, which pip checks again). Returns name -> wheel SHA-256."""
    into.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    with tempfile.TemporaryDirectory(prefix="rdma-netns-src-") as src:
        shutil.copytree(REPO, src, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__"))
        subprocess.run([*pip, "wheel", "--no-deps", "-w", str(into), src], check=True)
    deps = cache / "wheels"
    deps.mkdir(exist_ok=True)
    subprocess.run([*pip, "download", "-d", str(deps), "--require-hashes", "--no-deps", *lock.platform_args(),
                    "-r", str(lock.LOCK)], check=True)
    locked = {h: entry.name for entry in lock.read() for h in entry.hashes}
    hashes: dict[str, str] = {}
    for wheel in sorted(deps.glob("*.whl")):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest in locked:  # the cache may hold other versions, from older locks
            shutil.copy2(wheel, into / wheel.name)
            hashes[locked[digest]] = digest
    missing = {e.name for e in lock.read()} - set(hashes)
    if missing:
        raise RuntimeError(f"pip download left no wheel matching the lock for {sorted(missing)}")
    shutil.copy2(lock.LOCK, into / release.LOCK_NAME)
    return hashes


def git_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


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
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.cache.mkdir(parents=True, exist_ok=True)
    sbom_out = args.out.with_name(args.out.name.removesuffix(".oci.tar") + ".cdx.json")
    with tempfile.TemporaryDirectory(prefix="rdma-netns-image-", dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        work = Path(tmp)
        roots = {"build-root": debian.root(args.cache, BUILD_ROOT, work / "build-root"),
                 "image-root": debian.root(args.cache, IMAGE_ROOT, work / "image-root")}
        wheel_hashes = wheels(args.cache, work / "wheels")
        log(f"release {args.release}: python closure and venv")
        built = release.build(work / "build-root", args.release, work / "wheels", test_hooks=args.test_hooks)
        image_root = work / "image-root"
        target = image_root / Path(release.PREFIX).relative_to("/")
        target.mkdir(parents=True)
        shutil.copytree(built.folder, target / args.release, symlinks=True)
        (target / "current").symlink_to(args.release)
        for tool in ("rdma-netns", "rdma-netns-dp"):
            link = image_root / "usr/local/bin" / tool
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f"{release.PREFIX}/{args.release}/venv/bin/{tool}")
        log("SBOM")
        document = sbom.build(image_root=image_root, build_root=work / "build-root", release_dir=built.folder,
                              release_path=f"{release.PREFIX}/{args.release}", origins=built.origins,
                              wheel_hashes=wheel_hashes, release=args.release, created=created, roots=roots)
        sbom.write(document, image_root / sbom.IN_IMAGE.lstrip("/"), sbom_out)
        log("layer and OCI archive")
        layer = oci.tree_layer(image_root)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        debian_date = min(facts.newest() for facts in roots.values())
        labels = {"org.opencontainers.image.title": "rdma-netns",
                  "org.opencontainers.image.version": args.release,
                  "org.opencontainers.image.created": created,
                  "org.opencontainers.image.revision": git_commit(),
                  "org.opencontainers.image.base.name": f"debian:{debian.SUITE} (mmdebstrap)",
                  "org.opencontainers.image.description": "RDMA for non-hostNetwork pods: device plugin "
                                                          "rdma-netns-dp and CNI plugin rdma-netns",
                  # The Debian archive's state the packages were taken from: the older of the two
                  # roots' newest InRelease Date, and each suite's Date per root.
                  "io.rdma-netns.debian.date": debian_date,
                  "io.rdma-netns.debian.suites": " ".join(f"{label}:{suite}={date}" for label, facts in roots.items()
                                                          for suite, date in sorted(facts.suites.items())),
                  "io.rdma-netns.sbom": sbom.IN_IMAGE}
        labels = {key: value for key, value in labels.items() if value}
        manifest = oci.write_archive(
            args.out, args.name, [layer],
            {"Cmd": ["rdma-netns-dp", "--config", "/etc/rdma-netns/dp.yaml"],
             "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"},
            labels=labels, created=created)
        release_bytes = sum(p.stat().st_size for p in built.folder.rglob("*") if p.is_file() and not p.is_symlink())
    repository = args.name.rsplit(":", 1)[0] if ":" in args.name.rsplit("/", 1)[-1] else args.name
    log(f"image digest {manifest}: pin it as {repository}@{manifest} (docs/install.md)")
    print(json.dumps({"image": args.name, "digest": manifest, "pinned": f"{repository}@{manifest}",
                      "archive": str(args.out), "sbom": str(sbom_out), "manifest": manifest,
                      "archiveBytes": args.out.stat().st_size, "layerBytes": len(layer.data),
                      "releaseBytes": release_bytes, "debianDate": debian_date, "testHooks": args.test_hooks,
                      "seconds": round(time.monotonic() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
