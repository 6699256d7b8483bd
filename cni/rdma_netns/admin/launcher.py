"""Write the small executable a CNI bin folder gets (`rdma-netns install-launcher DEST`).

The runtime executes /opt/cni/bin/rdma-netns once per pod event. This launcher starts Python
isolated and without the site module (`-IS`: ~2 ms faster, and no PYTHON* variables or user
site-packages from the runtime's environment can change what runs), then imports rdma-netns
from the exact folder it is installed in, its hot path from one compiled file (codecache.py)
written at the same time.
"""

from __future__ import annotations

import os
import sys

import rdma_netns
from rdma_netns import codecache
from rdma_netns.util import fsutil

TEMPLATE = """#!{python} -IS
# rdma-netns launcher, written by `rdma-netns install-launcher`; rewrite it after moving the install.
import sys
sys.path.insert(0, {packages!r})
from rdma_netns import codecache
codecache.use({cache!r})
from rdma_netns.entry import main
sys.exit(main())
"""
MAX_SHEBANG = 127  # Linux reads at most this much of a #! line on older kernels


def packages_folder() -> str:
    """The site-packages folder this rdma-netns is installed in."""
    return os.path.dirname(os.path.dirname(os.path.abspath(rdma_netns.__file__)))


def render() -> str:
    python = sys.executable
    packages = packages_folder()
    if len(f"#!{python} -IS") > MAX_SHEBANG or any(c.isspace() for c in python):
        raise ValueError(f"the interpreter path {python!r} is too long or has spaces for a #! line")
    return TEMPLATE.format(python=python, packages=packages, cache=codecache.path_for(packages))


def install(dest: str) -> str | None:
    """Write the launcher to `dest` atomically, mode 0755, after (re)writing the hot path's code
    cache; returns why the cache could not be written (the launcher then imports as usual), or None."""
    try:
        codecache.build(packages_folder())
        problem = None
    except Exception as exc:  # noqa: BLE001 - a read-only install, a failing child: only slower
        problem = f"no code cache ({type(exc).__name__}: {exc}); the launcher imports the ordinary way"
    fsutil.write_atomic(dest, render().encode(), 0o755)
    return problem
