"""The `rdma-netns` executable: a CNI plugin when CNI_COMMAND is set, the admin CLI otherwise.

Start-up time is part of every pod event, so this module imports only the standard library
pieces every command needs; each command pulls in its own code lazily. Not even os: its import
costs ~1 ms of a cold interpreter, and an ADD's grants question (grants/early.py) leaves before it,
so that the broker works while os and the rest load.
"""

from __future__ import annotations

import posix
import sys
from time import monotonic

from rdma_netns.grants import early as grants_early
from rdma_netns.spec.env import CniEnv, process_environ, read_env
from rdma_netns.spec.errors import DECODE_FAILURE, INCOMPATIBLE_VERSION, CniError
from rdma_netns.util import jsonio

INTERNAL_ERROR = 999
# The most of stdin a call reads. A network config is small: one from the API server (a Multus
# NetworkAttachmentDefinition, a ConfigMap) cannot exceed etcd's 1.5 MiB request limit, and the
# largest a runtime adds is GC's list of every attachment on the node (~100 bytes each: 40,000 fit).
# Read whole, a 200 MB config cost the call 790 MB of memory.
MAX_STDIN = 4 << 20


def main(argv: list[str] | None = None) -> int:
    environ = process_environ()
    if "CNI_COMMAND" in environ and not (argv or sys.argv[1:]):
        code = run_cni(environ)
        # The invocation is complete (output flushed, files closed): skip the interpreter's
        # module-by-module teardown, a few milliseconds of every pod event.
        sys.stderr.flush()
        posix._exit(code)
    from rdma_netns.admin.cli import main as admin_main

    return admin_main(argv)


def _emit(value: dict) -> None:
    sys.stdout.write(jsonio.dumps(value) + "\n")
    sys.stdout.flush()


def run_cni(environ: dict[str, str] | None = None, stdin: bytes | None = None) -> int:
    """One CNI invocation: result or error JSON on stdout, exit code 0 or 1; then one event to
    the device-plugin daemon's metrics (events.py), which never delays or fails the call."""
    started = monotonic()
    environ = process_environ() if environ is None else environ
    outcome = {"cmd": environ.get("CNI_COMMAND", ""), "code": 0,
               "net": "", "fifo": None}  # None: events.DEFAULT_PATH
    try:
        outcome["code"] = code = _run_cni(environ, stdin, outcome)
        return 0 if code == 0 else 1
    finally:
        if outcome["cmd"] != "VERSION":
            from rdma_netns import events

            fifo = events.DEFAULT_PATH if outcome["fifo"] is None else outcome["fifo"]
            events.send(fifo, outcome["cmd"], outcome["code"], monotonic() - started, outcome["net"])


def parse_config(data: bytes) -> dict:
    """The network config on stdin, a JSON object, or DECODE_FAILURE."""
    try:
        raw = jsonio.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CniError(DECODE_FAILURE, "config on stdin is not valid JSON", str(exc)) from None
    except RecursionError:
        raise CniError(DECODE_FAILURE, "config on stdin is nested too deeply to be a network config") from None
    if not isinstance(raw, dict):
        raise CniError(DECODE_FAILURE, "config on stdin must be a JSON object")
    return raw


def _run_cni(environ: dict[str, str] | None, stdin: bytes | None, outcome: dict) -> int:
    """run_cni's body: 0, or the CNI error code it wrote on stdout; `outcome` learns the network."""
    error_version = ""  # the config's own when it is one we speak, else the latest
    early = None
    try:
        env = read_env(environ)
        data = sys.stdin.buffer.read(MAX_STDIN + 1) if stdin is None else stdin
        if len(data) > MAX_STDIN:
            raise CniError(DECODE_FAILURE, f"config on stdin is larger than {MAX_STDIN >> 20} MiB, far more than "
                           "any network config; not read further")
        if env.command == "VERSION":
            from rdma_netns.spec import versions

            _emit(versions.version_result())
            return 0
        raw = parse_config(data)
        if env.command == "ADD":
            early = grants_early.send(raw, env.args)  # answered while the rest loads (grants/early.py)
        # Imported only now (not at the top): with the grants question on its way, their loading
        # overlaps the broker's work.
        from rdma_netns import events
        from rdma_netns.config import loader
        from rdma_netns.spec import versions

        events.reset()
        _describe_network(raw, outcome)
        if raw.get("cniVersion") in versions.SUPPORTED_VERSIONS:
            error_version = raw["cniVersion"]
        if env.command == "DEL":
            versions.require_supported(raw.get("cniVersion", ""))
            if _repeated_del(env, raw):
                return 0  # containerd sends DEL two or three times per pod: the repeats load nothing more
            cfg = loader.load_for_teardown(raw)  # a refused config must not stop teardown
        else:
            cfg = loader.load(raw)
            loader.apply_cni_args(cfg, env.args)  # DEL uses no per-call MAC; a bad one must not stop it
        if env.command == "ADD":
            from rdma_netns.commands import pairing

            _emit(pairing.add(env, cfg, early))
        elif env.command == "DEL":
            from rdma_netns.commands import teardown

            teardown.cmd_del(env, cfg)
        elif env.command == "CHECK":
            from rdma_netns.commands import check

            check.cmd_check(env, cfg)
        elif env.command == "STATUS":
            _require_11(cfg.cni_version, "STATUS")
            from rdma_netns.commands import status

            status.cmd_status(env, cfg)
        elif env.command == "GC":
            _require_11(cfg.cni_version, "GC")
            from rdma_netns.commands import gc

            gc.cmd_gc(env, cfg)
        return 0
    except CniError as exc:
        _emit(exc.to_json_dict(error_version or _latest()))
        return exc.code or INTERNAL_ERROR
    except Exception as exc:  # a bug or an unexpected kernel answer: still a CNI error, never a bare traceback
        import traceback

        traceback.print_exc(file=sys.stderr)
        _emit(CniError(INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}").to_json_dict(
            error_version or _latest()))
        return INTERNAL_ERROR
    finally:
        if early is not None:
            early.close()  # an answer nobody took: the call failed first, or its config pairs otherwise


def _latest() -> str:
    from rdma_netns.spec import versions

    return versions.LATEST


def _describe_network(raw: dict, outcome: dict) -> None:
    """The network's name and events FIFO, read from the raw config before validation: a call
    whose config is refused still counts (through the default FIFO when its own is unusable)."""
    name = raw.get("name")
    if isinstance(name, str) and len(name) <= 128:
        outcome["net"] = name
    path = raw.get("eventsFifo")
    if path == "" or (isinstance(path, str) and path.startswith("/") and len(path.encode()) <= 107
                      and "\0" not in path):
        outcome["fifo"] = path


def _repeated_del(env: CniEnv, raw: dict) -> bool:
    """True when an earlier DEL (or an ADD that attached nothing) left this attachment released.

    Checked before the config is validated (only its network name and stateDir, safely): a
    repeat never pays for validation, not even for a config this version would refuse."""
    from rdma_netns.config import loader
    from rdma_netns.state import StateStore

    try:
        net = loader.teardown_network(raw)
    except CniError:
        return False  # the full load reports it
    store = StateStore(net.state_dir, net.name)
    return store.already_released(env.container_id, env.ifname, net.lock_timeout)


def _require_11(version: str, command: str) -> None:
    from rdma_netns.spec import versions

    if not versions.at_least(version, "1.1.0"):
        raise CniError(INCOMPATIBLE_VERSION, f"{command} needs cniVersion 1.1.0 or later, not {version}")
