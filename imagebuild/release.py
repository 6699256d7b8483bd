"""The release folder /opt/rdma-netns-ds/<RELEASE>/: a Python that needs nothing of the host it
lands on, and a venv with rdma-netns in it.

The init container copies this folder to the same path on the node, where the CNI launcher runs it
outside any container, on a host whose own Python and libraries are unknown (or absent). So the
folder carries Debian's python3.11 with its whole library closure, the dynamic loader included:
`python/bin/python3.11` is patched (patchelf) to use `python/lib/ld-linux-x86-64.so.2` as its
interpreter and `python/lib` as its DT_RPATH (absolute: the folder has the same path in the image
and on the node, and $ORIGIN would need /proc), which the loader also searches for the extension
modules' libraries (they carry no search path of their own). The stdlib sits at
`python/lib/python3.11`, where Python finds it from the executable's own location.

Layout (the DaemonSet's install script depends on it):
    python/bin/python3.11   python/lib/{ld-linux-x86-64.so.2, libc.so.6, ..., python3.11/}
    venv/                   made from that python; rdma-netns and its dependencies installed
    BUILD-STAMP             hash of the tree: the init container refuses to mix builds
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

PREFIX = "/opt/rdma-netns-ds"
PYTHON = "python3.11"
LOADER = "ld-linux-x86-64.so.2"
LIB_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib", "usr/lib")
# The stdlib's parts a CNI plugin and a device plugin never import.
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "pydoc_data", "EXTERNALLY-MANAGED"}


def run(*argv: str, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), text=True, capture_output=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return proc


def needed(path: Path) -> list[str]:
    """The DT_NEEDED sonames of an ELF file (empty for a non-ELF file)."""
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            return []
    return run("patchelf", "--print-needed", str(path)).stdout.split()


def find_library(root: Path, soname: str) -> Path:
    for folder in LIB_DIRS:
        candidate = root / folder / soname
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{soname} is not in the build root's library folders ({', '.join(LIB_DIRS)})")


def copy_closure(root: Path, elves: list[Path], lib: Path) -> list[str]:
    """Copy every shared library `elves` need (recursively) from the build root into `lib`."""
    copied: list[str] = []
    todo = [n for elf in elves for n in needed(elf)]
    while todo:
        soname = todo.pop()
        if (lib / soname).exists() or soname == LOADER:
            continue
        source = find_library(root, soname)
        shutil.copy2(source.resolve(), lib / soname)
        copied.append(soname)
        todo.extend(needed(lib / soname))
    return copied


def elves_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.so*") if p.is_file() and not p.is_symlink())


def build(root: Path, release: str, wheels: Path, test_hooks: bool = False) -> Path:
    """Make <root>/opt/rdma-netns-ds/<release> from the build root's Debian python and `wheels`
    (rdma-netns and its dependencies, installed with --no-index). Returns the folder.
    `test_hooks`: a test build, whose plugin honours the test-only variables (the deploy suite's
    fake sysfs and /dev: rdma_netns/testhooks.py); a release image never is one."""
    home = Path(PREFIX) / release           # the path on the node and in the image
    out = root / home.relative_to("/")
    if out.exists():
        shutil.rmtree(out)
    python_dir = out / "python"
    (python_dir / "bin").mkdir(parents=True)
    lib = python_dir / "lib"
    lib.mkdir()
    shutil.copy2(root / "usr/bin" / PYTHON, python_dir / "bin" / PYTHON)
    for alias in ("python3", "python"):
        (python_dir / "bin" / alias).symlink_to(PYTHON)
    shutil.copytree(root / "usr/lib" / PYTHON, lib / PYTHON, symlinks=True,
                    ignore=lambda folder, names: [n for n in names if n in STDLIB_SKIP])
    shutil.copy2((root / "lib64" / LOADER).resolve() if (root / "lib64" / LOADER).exists()
                 else find_library(root, LOADER), lib / LOADER)
    copy_closure(root, [python_dir / "bin" / PYTHON, *elves_under(lib / PYTHON)], lib)
    run("patchelf", "--set-interpreter", str(home / "python/lib" / LOADER), "--force-rpath",
        "--set-rpath", str(home / "python/lib"), str(python_dir / "bin" / PYTHON))
    # The venv and the install run in the build root (the patched interpreter's path exists there)
    # with no network: the wheels were fetched on the host.
    staged = root / "tmp/rdma-netns-wheels"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(wheels, staged)
    python = str(home / "python/bin" / PYTHON)
    venv = home / "venv"
    chroot = (shutil.which("chroot") or "/usr/sbin/chroot", str(root))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "PIP_NO_CACHE_DIR": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    run(*chroot, python, "-m", "venv", str(venv), env=env)
    run(*chroot, str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
        "/tmp/rdma-netns-wheels", "rdma-netns", env=env)
    # pip and setuptools are for building the venv, not for running it
    run(*chroot, str(venv / "bin/python"), "-m", "pip", "uninstall", "-q", "-y", "pip", "setuptools", env=env)
    shutil.rmtree(staged)
    copy_closure(root, elves_under(out / "venv"), lib)
    # Byte code checked by hash, not by the source's mtime: the image layer's times are fixed, and
    # a timestamp .pyc would then be stale, recompiled on every CNI call where it cannot be written.
    run(*chroot, python, "-m", "compileall", "-q", "-f", "--invalidation-mode", "unchecked-hash",
        str(home / "python/lib" / PYTHON), str(venv / "lib"), env=env)
    for tool in ("rdma-netns", "rdma-netns-dp"):
        run(*chroot, str(venv / "bin" / tool), "--version", env=env)
    if test_hooks:
        from rdma_netns.testhooks import MARKER

        (package,) = (out / "venv/lib").glob("python3*/site-packages/rdma_netns")
        (package / MARKER).write_text("a test build: the test-only variables are honoured (rdma_netns/testhooks.py)\n")
    (out / "BUILD-STAMP").write_text(tree_hash(out) + "\n")
    return out


def tree_hash(folder: Path) -> str:
    """SHA-256 over every file's path and bytes (and every link's target), in sorted order."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder)).encode()
        if path.is_symlink():
            h.update(b"L" + rel + b"\0" + os.readlink(path).encode() + b"\0")
        elif path.is_file():
            h.update(b"F" + rel + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()
