"""The CNI hot path's compiled modules in one file, read once per pod event.

A CNI call imports about 40 Python modules (a granted ADD: this package's and the pure-Python
standard library modules they use). Through the ordinary import system each costs a folder
lookup, a .pyc open and read and its checks: about a third of their 5-7 ms of loading, measured
(docs/benchmarks.md). `rdma-netns install-launcher` writes them, compiled, into one file beside
the package (PATH below), and the launcher puts a finder in front of the import system that
serves them from it.

Never a wrong module: each entry keeps its source file's size and modification time, checked
(one stat) before it is used, like a .pyc's own check; a module whose source changed since (an
upgrade in place without a new launcher) is imported the ordinary way. An unreadable or foreign
file (another Python's bytecode) is ignored. So a stale or broken cache costs speed, never
correctness. Imports only what the interpreter has already loaded (no __future__ either).

Layout (FORMAT 2): 8 bytes giving the index's length, the marshalled index (format, cache tag,
name -> (is_package, source path, size, mtime_ns, offset, length)), then each module's marshalled
code. use() reads the index alone and a module's code is read (pread) when it is imported: a call
that pairs a pod out reads a fifth of the file, where reading and unmarshalling all of it cost
~0.6 ms of every call.
"""

import marshal
import posix  # not os: its import costs ~1 ms of a cold interpreter, and the grants question leaves first
import sys

FORMAT = 2
HEAD = 8  # the index's length, big-endian
FIRST_READ = 16384  # the index of ~50 modules fits: one read
OPTIMIZE = 2
FILE_NAME = f"cni-hot-path.{sys.implementation.cache_tag}.bundle"
# What a CNI call can load, as import roots; build() takes their whole import closure. Modules a
# command imports later, inside a function, are roots too when they are common enough.
ROOTS = ("rdma_netns.entry", "rdma_netns.commands.pairing", "rdma_netns.commands.add", "rdma_netns.commands.teardown",
         "rdma_netns.commands.check", "rdma_netns.commands.gc", "rdma_netns.commands.status",
         "rdma_netns.rails.node_range", "rdma_netns.kernel.netns_sysfs", "rdma_netns.modes.exclusive")
_ModuleSpec = type(sys.__spec__)  # importlib's ModuleSpec, without importing importlib


def path_for(packages: str) -> str:
    """Where the file of the package installed in `packages` (a site-packages folder) lives."""
    return f"{packages}/rdma_netns/__pycache__/{FILE_NAME}"


class Finder:
    """A meta path finder serving the cached modules whose sources are unchanged."""

    def __init__(self, fd: int, base: int, modules: dict) -> None:
        self.fd, self.base = fd, base  # the open file, and where the modules' code starts
        self.modules = modules  # name -> (is_package, source path, size, mtime_ns, offset, length)
        self.code: dict = {}  # name -> code object, between find_spec and exec_module

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        entry = self.modules.get(name)
        if entry is None:
            return None
        is_package, origin, size, mtime_ns = entry[:4]
        try:
            st = posix.stat(origin)
        except OSError:
            st = None
        if st is None or st.st_size != size or st.st_mtime_ns != mtime_ns:
            del self.modules[name]  # changed or gone: the ordinary finders decide
            return None
        offset, length = entry[4:]
        try:
            blob = posix.pread(self.fd, length, self.base + offset)
            code = marshal.loads(blob) if len(blob) == length else None
        except (OSError, ValueError, EOFError, TypeError):
            code = None
        if code is None:
            del self.modules[name]  # a file cut short or damaged: the ordinary finders decide
            return None
        self.code[name] = code
        spec = _ModuleSpec(name, self, origin=origin, is_package=is_package)
        spec.has_location = True  # __file__ = origin, as the ordinary loader sets it
        if is_package:
            spec.submodule_search_locations = [origin.rpartition("/")[0]]  # its other modules, found as usual
        return spec

    def create_module(self, spec: object) -> None:
        return None  # the default module object

    def exec_module(self, module: object) -> None:
        name = module.__spec__.name  # type: ignore[attr-defined]
        del self.modules[name]
        exec(self.code.pop(name), module.__dict__)  # noqa: S102 - our own compiled package code


def use(path: str) -> bool:
    """Put the finder of the file at `path` first in sys.meta_path; False (and nothing changed)
    when the file is missing, unreadable, or not this Python's."""
    try:
        fd = posix.open(path, posix.O_RDONLY | posix.O_CLOEXEC)
    except OSError:
        return False
    try:
        data = posix.read(fd, FIRST_READ)
        length = int.from_bytes(data[:HEAD], "big")
        if len(data) < HEAD + length:
            data += posix.read(fd, HEAD + length - len(data))
        form, tag, modules = marshal.loads(data[HEAD:HEAD + length])
    except Exception:  # noqa: BLE001 - truncated, garbage: the ordinary import system works
        posix.close(fd)
        return False
    if form != FORMAT or tag != sys.implementation.cache_tag or not isinstance(modules, dict):
        posix.close(fd)
        return False
    sys.meta_path.insert(0, Finder(fd, HEAD + length, modules))  # fd: open for the call's lifetime
    return True


_LIST_SCRIPT = """
import sys
before = set(sys.modules)
sys.path.insert(0, sys.argv[1])
for root in sys.argv[2:]:
    __import__(root)
for name, module in sorted(sys.modules.items()):
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    if name not in before and isinstance(origin, str) and origin.endswith(".py"):
        print(name, int(hasattr(module, "__path__")), origin)
"""


def hot_modules(packages: str, roots: tuple[str, ...] = ROOTS) -> list[tuple[str, bool, str]]:
    """(name, is_package, source) of every pure-Python module importing `roots` loads, as a
    launcher's interpreter (-IS, a fresh process) loads them."""
    import subprocess

    out = subprocess.run([sys.executable, "-IS", "-c", _LIST_SCRIPT, packages, *roots], check=True,
                         capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        name, is_package, origin = line.split(" ", 2)
        found.append((name, is_package == "1", origin))
    return found


def build(packages: str, dest: str | None = None) -> int:
    """Write the file for the package installed in `packages`; returns how many modules it holds."""
    import os

    from rdma_netns.util import fsutil

    modules = {}
    blobs: list[bytes] = []
    offset = 0
    for name, is_package, origin in hot_modules(packages):
        st = os.stat(origin)
        with open(origin, "rb") as f:
            # optimize=2 drops docstrings (and asserts, which the hot path does not use for its
            # checks): ~14% less code to unmarshal, the largest part of loading a module.
            code = compile(f.read(), origin, "exec", dont_inherit=True, optimize=OPTIMIZE)
        blob = marshal.dumps(code)
        modules[name] = (is_package, origin, st.st_size, st.st_mtime_ns, offset, len(blob))
        blobs.append(blob)
        offset += len(blob)
    index = marshal.dumps((FORMAT, sys.implementation.cache_tag, modules))
    dest = dest or path_for(packages)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fsutil.write_atomic(dest, len(index).to_bytes(HEAD, "big") + index + b"".join(blobs), 0o644)
    return len(modules)
