#!/usr/bin/env bash
# The longer random search over the property tests, for developers before they submit. CI runs
# the same tests derandomized (tests/hypothesis_profiles.py), so a CI run never depends on a lucky
# draw; this script draws new examples every run, HYPOTHESIS_SEARCH_FACTOR (default 20) times CI's
# budget. A failure prints its example and a @reproduce_failure blob: make it a regular test
# (a plain pytest case with that input, next to the property test) and fix the bug
# (docs/testing.md: "Property tests"). Needs root for the netns-backed tests (tests/faults).
#
#   scripts/property-search.sh                       # every property test
#   scripts/property-search.sh tests/unit/test_spec.py -k netns
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
if [ $# -eq 0 ]; then
    mapfile -t files < <(grep -rl --include='test_*.py' '^from hypothesis import' tests | sort)
    set -- "${files[@]}"
fi
HYPOTHESIS_PROFILE=search exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider "$@"
