"""Fault-injection fixtures: the netns suite's Node (re-exported) and the device plugin harness."""

from __future__ import annotations

from tests.dp.conftest import host  # noqa: F401  (re-exported fixture)
from tests.netns.conftest import node  # noqa: F401  (re-exported fixture)
