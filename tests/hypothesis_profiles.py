"""Hypothesis profiles: CI's deterministic run, and the longer random search developers run.

`ci` (the default): derandomized (each property test draws the same examples on every run, from a
seed derived from the test), no example database written, each test's own `examples(n)` budget.
So CI refuses a submission only for a bug its own change makes reachable, never for one that a
lucky draw happened to hit this time.

`search` (`HYPOTHESIS_PROFILE=search`, or scripts/property-search.sh): random seeds, each budget
times HYPOTHESIS_SEARCH_FACTOR (default 20), failures printed with the `@reproduce_failure` blob.
What it finds becomes a regular test (docs/testing.md: "Property tests").
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SEARCH_FACTOR = int(os.environ.get("HYPOTHESIS_SEARCH_FACTOR", "20"))

# No deadline: these tests prove what the code does, not how fast; on a loaded 2-core machine a
# 0.07 ms example once took 269 ms and hypothesis' default 200 ms deadline failed it (the first
# search run, issue 36). Time limits live in tests of their own.
settings.register_profile("ci", derandomize=True, database=None, max_examples=100, deadline=None, print_blob=True)
settings.register_profile("search", derandomize=False, database=None, max_examples=100 * SEARCH_FACTOR,
                          deadline=None, print_blob=True)
settings.load_profile(PROFILE)


def examples(ci_budget: int) -> int:
    """A test's max_examples: its CI budget, or that times the search factor in the search profile."""
    return ci_budget if PROFILE == "ci" else ci_budget * SEARCH_FACTOR
