"""Readiness files that Kubernetes' exec probes read with the shell.

A probe that starts Python costs the node a Python start-up every period (tens of ms on a server,
seconds on a loaded or emulated node, where a timed-out exec probe keeps running and piles up).
The long-running daemons already know the answer: they write it here, and the probe is `sh`
reading the first line and the file's age (deploy/helm/rdma-netns/templates/_helpers.tpl,
"rdma-netns.fileProbe").

Format: the first line is `ready` or `not ready: <why>`; further lines are details (a probe's
output is what `kubectl describe pod` shows).
"""

from __future__ import annotations

import os

from rdma_netns.util import fsutil

READY = "ready"


def render(problems: list[str]) -> str:
    """The file's text: `ready`, or `not ready: ` and the problems, one per line."""
    if not problems:
        return READY + "\n"
    return "not ready: " + "\n".join(problems) + "\n"


def write(path: str, problems: list[str]) -> None:
    """Rewrite the file whole (its mtime is the writer's heartbeat); readable by any user."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fsutil.write_atomic(path, render(problems).encode(), 0o644)
