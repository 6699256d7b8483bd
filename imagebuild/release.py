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
from dataclasses import dataclass
from pathlib import Path

PREFIX = "/opt/rdma-netns-ds"
PYTHON = "python3.11"
LOADER = "ld-linux-x86-64.so.2"
LIB_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib", "usr/lib")
# The stdlib's parts a CNI plugin and a device plugin never import (nor do their dependencies:
# checked with grep over the installed site-packages; the build imports every module of ours).
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "pydoc_data", "EXTERNALLY-MANAGED",
               "distutils", "sqlite3", "dbm", "curses", "turtle.py"}
# Extension modules of lib-dynload never imported either: the test ones, and those whose only job is
# a native library nothing here uses (leaving them out leaves out libsqlite3, libdb, ncurses,
# readline, libcrypt and libnsl with its Kerberos closure: the host gets none of them).
DYNLOAD_SKIP = {"_crypt", "_curses", "_curses_panel", "_dbm", "_gdbm", "_sqlite3", "nis", "readline",
                "ossaudiodev", "_ctypes_test", "_testbuffer", "_testcapi", "_testclinic",
                "_testimportmultiple", "_testinternalcapi", "_testmultiphase", "_xxtestfuzz",
                "xxlimited", "xxlimited_35"}
# Needed to make the venv (python -m venv runs it), never after.
AFTER_VENV_SKIP = ("ensurepip",)


def _stdlib_ignore(folder: str, names: list[str]) -> list[str]:
    skip = [n for n in names if n in STDLIB_SKIP]
    if os.path.basename(folder) == "lib-dynload":
        skip += [n for n in names if n.split(".", 1)[0] in DYNLOAD_SKIP]
    return skip


LOCK_NAME = "requirements.lock"
IMPORT_ALL = """
import importlib, pkgutil
import rdma_netns, rdma_netns_dp
for package in (rdma_netns, rdma_netns_dp):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith(".__main__"):
            importlib.import_module(module.name)
"""


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


def in_root(root: Path, path: Path) -> Path:
    """`path` (under `root`) with its symlinks followed as the root sees them: an absolute link
    target is inside the root, never the build machine's own file (Path.resolve() would take
    /lib64/ld-linux-x86-64.so.2 -> /lib/... from this machine)."""
    for _ in range(40):
        if not path.is_symlink():
            return Path(os.path.normpath(path))
        target = os.readlink(path)
        path = root / target.lstrip("/") if os.path.isabs(target) else path.parent / target
    raise RuntimeError(f"{path}: too many levels of symbolic links")


def origin(root: Path, path: Path) -> str:
    """`path`'s location as the root spells it (for dpkg's file lists)."""
    return "/" + os.path.relpath(path, root)


def find_library(root: Path, soname: str) -> Path:
    for folder in LIB_DIRS:
        candidate = root / folder / soname
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{soname} is not in the build root's library folders ({', '.join(LIB_DIRS)})")


def copy_closure(root: Path, elves: list[Path], lib: Path) -> dict[str, str]:
    """Copy every shared library `elves` need (recursively) from the build root into `lib`;
    returns soname -> the path it came from in the build root (for the SBOM)."""
    copied: dict[str, str] = {}
    todo = [n for elf in elves for n in needed(elf)]
    while todo:
        soname = todo.pop()
        if (lib / soname).exists() or soname == LOADER:
            continue
        source = in_root(root, find_library(root, soname))
        shutil.copy2(source, lib / soname)
        copied[soname] = origin(root, source)
        todo.extend(needed(lib / soname))
    return copied


def elves_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.so*") if p.is_file() and not p.is_symlink())


@dataclass
class Release:
    folder: Path                # <build root>/opt/rdma-netns-ds/<release>
    origins: dict[str, str]     # path in the folder -> the Debian file it was copied from (build root)


def build(root: Path, release: str, wheels: Path, test_hooks: bool = False) -> Release:
    """Make <root>/opt/rdma-netns-ds/<release> from the build root's Debian python and `wheels`
    (rdma-netns and its dependencies as imagebuild/requirements.lock pins them, installed with
    --no-index --require-hashes).
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
    origins = {f"python/bin/{PYTHON}": f"/usr/bin/{PYTHON}"}
    shutil.copy2(root / "usr/bin" / PYTHON, python_dir / "bin" / PYTHON)
    for alias in ("python3", "python"):
        (python_dir / "bin" / alias).symlink_to(PYTHON)
    shutil.copytree(root / "usr/lib" / PYTHON, lib / PYTHON, symlinks=True, ignore=_stdlib_ignore)
    loader = in_root(root, find_library(root, LOADER))
    shutil.copy2(loader, lib / LOADER)
    origins[f"python/lib/{LOADER}"] = origin(root, loader)
    libs = copy_closure(root, [python_dir / "bin" / PYTHON, *elves_under(lib / PYTHON)], lib)
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
    pip = (*chroot, str(venv / "bin/python"), "-m", "pip")
    # The dependencies exactly as locked: every file must match a hash of imagebuild/requirements.lock
    # (pip refuses anything else), then our own wheel of this checkout without resolving anything,
    # then pip's own check that the locked versions satisfy what rdma-netns declares.
    run(*pip, "install", "-q", "--no-index", "--find-links", "/tmp/rdma-netns-wheels", "--require-hashes",
        "--no-deps", "-r", f"/tmp/rdma-netns-wheels/{LOCK_NAME}", env=env)
    (ours,) = [w.name for w in staged.glob("rdma_netns-*.whl")]
    run(*pip, "install", "-q", "--no-index", "--no-deps", f"/tmp/rdma-netns-wheels/{ours}", env=env)
    run(*pip, "check", env=env)
    # pip and setuptools are for building the venv, not for running it
    run(*pip, "uninstall", "-q", "-y", "pip", "setuptools", env=env)
    shutil.rmtree(staged)
    for name in AFTER_VENV_SKIP:
        shutil.rmtree(lib / PYTHON / name)
    libs.update(copy_closure(root, elves_under(out / "venv"), lib))
    origins.update({f"python/lib/{soname}": source for soname, source in libs.items()})
    for path in sorted((lib / PYTHON).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            rel = path.relative_to(lib / PYTHON)
            origins[f"python/lib/{PYTHON}/{rel}"] = f"/usr/lib/{PYTHON}/{rel}"
    # Byte code checked by hash, not by the source's mtime: the image layer's times are fixed, and
    # a timestamp .pyc would then be stale, recompiled on every CNI call where it cannot be written.
    run(*chroot, python, "-m", "compileall", "-q", "-f", "--invalidation-mode", "unchecked-hash",
        str(home / "python/lib" / PYTHON), str(venv / "lib"), env=env)
    for tool in ("rdma-netns", "rdma-netns-dp"):
        run(*chroot, str(venv / "bin" / tool), "--version", env=env)
    # Every module of ours imports with what is left (a stdlib part cut above that something needs
    # fails the build here, not on a node).
    run(*chroot, str(venv / "bin/python"), "-I", "-B", "-c", IMPORT_ALL, env=env)
    if test_hooks:
        from rdma_netns.testhooks import MARKER

        (package,) = (out / "venv/lib").glob("python3*/site-packages/rdma_netns")
        (package / MARKER).write_text("a test build: the test-only variables are honoured (rdma_netns/testhooks.py)\n")
    (out / "BUILD-STAMP").write_text(tree_hash(out) + "\n")
    return Release(out, origins)


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
