"""The CNI commands, one module each (ADD, DEL, CHECK, STATUS, GC; VERSION is entry.py's).

Policy lives here; kernel access goes through kernel/, per-mode interface moves through
modes/, each rail's plan, IPAM, addresses and routing through rails/. Every ADD writes its state
before the first change, so that a crash at any point leaves a record DEL (or GC) can undo.
entry.py imports only the command it runs; an ADD goes through pairing.py first, which asks
grants/ what the pod was granted and loads add.py only for a pod that gets rails. Modules here
may import every layer below (modes/, grants/, rails/, publish/, config/, kernel/, spec/,
state.py, events.py, faults.py); only entry.py imports them.
"""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """Runtimes keep a plugin's stderr in their logs; stdout is reserved for the result."""
    print(f"rdma-netns: {message}", file=sys.stderr)
