"""`status` checks of what the runtime runs: the chained entry in the primary CNI config, the launcher.

The entry rules (when it is required, what "matches" means) are in status.py's docstring. The
launcher is run the way a runtime runs it (argv, no shell, CNI_COMMAND=VERSION), bounded by
LAUNCHER_TIMEOUT, and once with --version to see which rdma-netns it starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib

from rdma_netns import __version__
from rdma_netns.admin import cni_conf
from rdma_netns.admin import runtime_cdi as runtime_cdi_setting
from rdma_netns.admin.status_context import FAIL, OK, WARN, Check, Context
from rdma_netns.admin.uninstall import LAUNCHER_MARK

LAUNCHER_TIMEOUT = 5.0
NEEDED_VERSIONS = ("1.0.0", "1.1.0")
DS_POD = ("`kubectl -n kube-system get pods -l app.kubernetes.io/name=rdma-netns-dp -o wide "
          "--field-selector spec.nodeName=<this node>`")


def _insert_fix(ctx: Context) -> str:
    entry = ctx.opts.entry_path or "<the ConfigMap's rdma-netns-chained-entry.json>"
    return (f"`rdma-netns cni-conf insert --conf-dir {ctx.opts.cni_conf_dir} --state-dir "
            f"{ctx.opts.cni_conf_state_dir} --entry {entry}`; on a DaemonSet node the pod's cni-conf-watch "
            f"container keeps it there: find the pod with {DS_POD} and read `kubectl logs <pod> -c cni-conf-watch`")


def chained_entry(ctx: Context) -> list[Check]:
    g, name = "Chained entry", "entry"
    record = ctx.record_state.load() if ctx.record_state.file.exists() else None
    required = ctx.opts.entry is not None or record is not None
    why = "--entry was given" if ctx.opts.entry is not None else f"{ctx.record_state.file} records an insert"
    where = f"{ctx.opts.cni_conf_dir}/{ctx.primary}" if ctx.primary else ctx.opts.cni_conf_dir
    data: dict = {"primary": ctx.primary, "required": required, "tracked": record is not None}
    if ctx.primary is None:
        if not required:
            return [Check(g, name, OK, f"not used: no primary CNI config in {ctx.opts.cni_conf_dir}", data=data)]
        return [Check(g, name, FAIL, f"no primary CNI config in {ctx.opts.cni_conf_dir} ({why}): pods get no "
                      "network at all", "start the cluster CNI (it writes the primary); the entry is chained into "
                      "it then", data)]
    if ctx.primary_error:
        return [Check(g, name, FAIL, f"{where}: {ctx.primary_error}", f"the cluster CNI owns {ctx.primary}: "
                      "let it write the file again (restart its node agent); rdma-netns leaves a broken file alone",
                      data)]
    count = len(ctx.chained)
    if count == 0:
        if not required:
            return [Check(g, name, OK, f"not used: {ctx.primary} has no rdma-netns entry and none was inserted "
                          "(Multus, the standalone conflist, or the DaemonSet's switch off); --entry requires one",
                          data=data)]
        return [Check(g, name, FAIL, f"missing from {where} ({why}): pods start without rails",
                      _insert_fix(ctx), data)]
    plugins = ctx.primary_doc.get("plugins", []) if ctx.primary_doc else []
    position = max(i for i, p in enumerate(plugins) if isinstance(p, dict) and p.get("type") == cni_conf.PLUGIN_TYPE)
    data.update(position=position + 1, plugins=len(plugins))
    at = f"in {where} (plugin {position + 1} of {len(plugins)})"
    if count > 1:
        return [Check(g, name, FAIL, f"{count} rdma-netns entries {at}: each pod would be wired {count} times",
                      _insert_fix(ctx) + " (it keeps one)", data)]
    entry = ctx.chained[0]
    try:
        cni_conf.check_entry(entry, ctx.primary_doc.get("cniVersion"), ctx.primary_doc.get("name"))
    except cni_conf.CniConfError as exc:
        return [Check(g, name, FAIL, f"{at}: {exc}: every pod's ADD fails", "correct the entry (the ConfigMap's "
                      "rdma-netns-chained-entry.json; `rdma-netns check-config FILE` says what is wrong), then "
                      + _insert_fix(ctx), data)]
    if ctx.opts.entry is not None and entry != ctx.opts.entry:
        keys = sorted(k for k in set(entry) | set(ctx.opts.entry) if entry.get(k) != ctx.opts.entry.get(k))
        data["differs"] = keys
        return [Check(g, name, FAIL, f"{at}, but not what --entry says (differs in: {', '.join(keys)}): pods are "
                      "wired by another config than the DaemonSet's", _insert_fix(ctx), data)]
    notes = []
    if ctx.primary != (cni_conf.conf_files(ctx.conf_dir) or [None])[0]:
        notes.append(f"the runtime uses {cni_conf.conf_files(ctx.conf_dir)[0]}, which sorts first")
    if record is not None and record.get("file") != ctx.primary:
        return [Check(g, name, WARN, f"{at}, but the record names {record.get('file')}",
                      _insert_fix(ctx) + " (it moves the record to the current primary)", data)]
    if record is not None and record.get("writtenSha256") != cni_conf.sha256(ctx.primary_bytes or b""):
        return [Check(g, name, WARN, f"{at}; {ctx.primary} changed since the entry was inserted (the cluster CNI "
                      "or someone rewrote it)", "a running cni-conf watch looks again within its interval; "
                      "without one: " + _insert_fix(ctx), data)]
    how = "equal to --entry" if ctx.opts.entry is not None else \
        "as inserted (sha256 matches the record)" if record is not None else "not tracked by a cni-conf record"
    return [Check(g, name, OK, f"{at}, {how}" + "".join(f"; {n}" for n in notes), data=data)]


def runtime_cdi(ctx: Context) -> list[Check]:
    """containerd passes the CDI devices kubelet names (a pod's NCCL/UCX settings, rails.json) only
    with enable_cdi on (runtime_cdi.py)."""
    g, name, path = "Runtime", "CDI", ctx.opts.containerd_config
    try:
        found = runtime_cdi_setting.containerd(path)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return [Check(g, name, WARN, f"cannot read {path}: {exc}", "check that the file is containerd's config")]
    if found is None:
        return [Check(g, name, OK, f"not checked: no containerd config at {path} (CRI-O and containerd 2.x have "
                      "CDI on; containerd 1.7 without a config file has it off)")]
    data = {"config": path, "version": found.version, "section": found.section, "enable_cdi": found.enabled}
    if found.enabled:
        return [Check(g, name, OK, f"{path}: enable_cdi on ({found.where})", data=data)]
    state = FAIL if ctx.config is not None else WARN
    return [Check(g, name, state, f"{found.loss} (NCCL then guesses its GID index)", found.fix, data)]


def launcher(ctx: Context) -> list[Check]:
    """<cni-bin>/rdma-netns exists, runs, answers VERSION with the versions the config needs."""
    g, name = "Launcher", "launcher"
    path = os.path.join(ctx.opts.cni_bin_dir, "rdma-netns")
    needed = ctx.config is not None
    reinstall = (f"`rdma-netns install-launcher {path}` (a DaemonSet's install-cni container writes it when its "
                 "pod starts)")
    if not os.path.isfile(path):
        if not needed:
            return [Check(g, name, WARN, f"no launcher at {path} (and no rdma-netns config uses one)", reinstall)]
        return [Check(g, name, FAIL, f"no launcher at {path}: the runtime cannot run the rdma-netns in "
                      f"{ctx.config_source}, so every such pod fails to start", reinstall)]
    if not os.access(path, os.X_OK):
        return [Check(g, name, FAIL, f"{path} is not executable", f"`chmod 0755 {path}`")]
    try:
        with open(path, "rb") as f:
            head = f.read(512).decode(errors="replace")
    except OSError as exc:
        return [Check(g, name, FAIL, f"cannot read {path}: {exc.strerror}", reinstall)]
    shebang = head.splitlines()[0][2:].strip() if head.startswith("#!") else ""
    data: dict = {"path": path, "interpreter": shebang, "ours": LAUNCHER_MARK in head}
    answer, error = _run(path, {"CNI_COMMAND": "VERSION"}, b'{"cniVersion":"1.0.0"}')
    if error is not None:
        return [Check(g, name, FAIL, f"{path} fails VERSION: {error}", reinstall + " from the current install", data)]
    try:
        supported = json.loads(answer).get("supportedVersions") or []
    except (ValueError, AttributeError):
        return [Check(g, name, FAIL, f"{path} answers VERSION with no JSON: {answer[:120]!r}", reinstall, data)]
    data["supportedVersions"] = supported
    wanted = list(NEEDED_VERSIONS)
    if ctx.setting("cniVersion"):
        wanted.append(ctx.setting("cniVersion"))
    missing = [v for v in dict.fromkeys(wanted) if v not in supported]
    if missing:
        return [Check(g, name, FAIL, f"{path} does not speak cniVersion {', '.join(missing)} (it lists "
                      f"{', '.join(supported) or 'nothing'})", reinstall + " from a current release", data)]
    version_text, error = _run(path, {}, b"", "--version")
    theirs = version_text.split()[-1] if error is None and version_text.split() else "?"
    data["version"] = theirs
    detail = f"{path} answers VERSION ({', '.join(supported)}); runs rdma-netns {theirs}"
    if not data["ours"]:
        detail += " (not written by install-launcher)"
    if theirs != __version__:
        return [Check(g, name, WARN, f"{detail}, this tool is {__version__}", "expected during a rolling update; "
                      f"otherwise rewrite it: {reinstall}", data)]
    return [Check(g, name, OK, detail, data=data)]


def _run(path: str, env: dict[str, str], stdin: bytes, *args: str) -> tuple[str, str | None]:
    """(stdout, None) or ("", why it failed): argv only, a clean environment, bounded."""
    clean = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **env}
    try:
        proc = subprocess.run([path, *args], input=stdin, env=clean, capture_output=True,
                              timeout=LAUNCHER_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return "", f"no answer in {LAUNCHER_TIMEOUT:g} s"
    except OSError as exc:
        return "", f"cannot run it: {exc.strerror or exc} (its #! interpreter gone?)"
    out = proc.stdout.decode(errors="replace").strip()
    if proc.returncode != 0:
        tail = (out or proc.stderr.decode(errors="replace").strip())[-200:]
        return "", f"exit {proc.returncode}: {tail}"
    return out, None
