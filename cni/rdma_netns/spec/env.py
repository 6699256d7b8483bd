"""The CNI_* environment, validated before anything touches the host."""

from __future__ import annotations

import sys

from rdma_netns.spec.errors import INVALID_ENV, CniError

COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC")
# Commands that act on one attachment and so need a container ID and an ifname.
ATTACHMENT_COMMANDS = ("ADD", "DEL", "CHECK")

MAX_CONTAINER_ID = 256


def valid_ifname(name: str) -> bool:
    """Linux's dev_valid_name(): 1-15 bytes, not '.' or '..', no '/', ':' or whitespace."""
    if not name or len(name.encode()) > 15 or name in (".", ".."):
        return False
    return not any(c in "/:" or c.isspace() for c in name)


def valid_container_id(cid: str) -> bool:
    """The spec's rule: an ASCII letter or digit first, then letters, digits, '_', '.', '-'."""
    return (0 < len(cid) <= MAX_CONTAINER_ID and cid.isascii() and cid[0].isalnum()
            and all(c.isalnum() or c in "_.-" for c in cid))


class CniEnv:
    """The validated CNI_* variables of one invocation."""

    __slots__ = ("command", "container_id", "netns", "ifname", "args", "path")

    def __init__(self, command: str, container_id: str = "", netns: str = "", ifname: str = "",
                 args: dict[str, str] | None = None, path: list[str] | None = None) -> None:
        self.command, self.container_id, self.netns, self.ifname = command, container_id, netns, ifname
        self.args = args or {}
        self.path = path or []


def parse_cni_args(raw: str) -> dict[str, str]:
    """CNI_ARGS is 'K1=V1;K2=V2'. Malformed pairs are an error, not silently dropped."""
    out: dict[str, str] = {}
    for pair in filter(None, raw.split(";")):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CniError(INVALID_ENV, f"CNI_ARGS: malformed pair {pair!r} (want KEY=VALUE)")
        out[key] = value
    return out


def process_environ() -> dict[str, str]:
    """The process's environment as os.environ has it, without importing os when nothing has:
    `import os` costs ~1 ms of a cold interpreter (_collections_abc), and the grants question
    (grants/early.py) leaves before it. Decoded as os.environ decodes (the filesystem encoding,
    surrogateescape). Once os is loaded its live mapping is used (it sees later changes)."""
    os_module = sys.modules.get("os")
    if os_module is not None:
        return os_module.environ  # type: ignore[no-any-return]
    if not _decoded:
        from posix import environ

        encoding, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
        _decoded.update((k.decode(encoding, errors), v.decode(encoding, errors)) for k, v in environ.items())
    return _decoded


_decoded: dict[str, str] = {}  # process_environ's, decoded once (nothing changes it while os is not loaded)


def read_env(environ: dict[str, str] | None = None) -> CniEnv:
    environ = process_environ() if environ is None else environ
    command = environ.get("CNI_COMMAND", "")
    if command not in COMMANDS:
        raise CniError(INVALID_ENV, f"unknown CNI_COMMAND {command!r}", f"expected one of {', '.join(COMMANDS)}")
    env = CniEnv(
        command=command,
        container_id=environ.get("CNI_CONTAINERID", ""),
        netns=environ.get("CNI_NETNS", ""),
        ifname=environ.get("CNI_IFNAME", ""),
        args=parse_cni_args(environ.get("CNI_ARGS", "")),
        path=[p for p in environ.get("CNI_PATH", "").split(":") if p],
    )
    if command in ATTACHMENT_COMMANDS:
        if not env.container_id:
            raise CniError(INVALID_ENV, "CNI_CONTAINERID is required")
        if not valid_container_id(env.container_id):
            raise CniError(INVALID_ENV, f"invalid CNI_CONTAINERID {env.container_id[:80]!r}")
        if not valid_ifname(env.ifname):
            raise CniError(INVALID_ENV, f"invalid CNI_IFNAME {env.ifname[:80]!r}")
        if command != "DEL" and not env.netns:
            raise CniError(INVALID_ENV, "CNI_NETNS is required")
        if env.netns:
            validate_netns_path(env.netns)
    return env


def validate_netns_path(path: str) -> None:
    """A netns path must be absolute and normalised; whether it *is* a netns is checked on open."""
    if not path.startswith("/") or "\0" in path or not is_normalised(path) or len(path) > 4096:
        raise CniError(INVALID_ENV, f"invalid CNI_NETNS path {path[:200]!r}")


def is_normalised(path: str) -> bool:
    """posixpath.normpath(path) == path for an absolute path, without posixpath (it imports os):
    no empty, "." or ".." component and no trailing slash; POSIX keeps exactly two leading
    slashes as they are, as normpath does."""
    body = path[2:] if path.startswith("//") and not path.startswith("///") else path[1:]
    return not body or all(part not in ("", ".", "..") for part in body.split("/"))

