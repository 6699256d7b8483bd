#!/usr/bin/env bash
# Regenerate imagebuild/requirements.lock: pyproject.toml's dependencies resolved for the image's
# Python (CPython 3.11, x86_64 glibc), one wheel each with its SHA-256. scripts/build-image.sh
# installs exactly these (pip --require-hashes). Run it after changing pyproject.toml's
# dependencies, or to take newer releases, and review the diff. Needs PyPI (or PIP_INDEX_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh >/dev/null
exec .venv/bin/python -m imagebuild.lock "$@"
