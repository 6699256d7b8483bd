"""Debian 12 roots from mmdebstrap, cached as tarballs for at most MAX_AGE_DAYS.

A root is fetched from bookworm, bookworm-updates and bookworm-security (the last carries the
glibc/OpenSSL fixes between point releases). The cache is keyed by the recipe (variant,
packages, sources, dpkg options) and expires: a root older than RDMA_NETNS_DEBIAN_MAX_AGE_DAYS
(default 7; 0 fetches every time) is fetched again, so a rebuilt image never carries packages
older than that. The Date of each suite's InRelease the packages came from is kept next to the
tarball; the build writes it into the image's labels and SBOM.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

SUITE = "bookworm"
MIRROR = os.environ.get("RDMA_NETNS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# "" leaves the security suite out (a private mirror without it; the image is then only as fresh
# as the mirror's point release).
SECURITY_MIRROR = os.environ.get("RDMA_NETNS_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
DAY = 86400
RECIPE = 2  # bump when a root's recipe changes in a way the key below does not see


def max_age_seconds() -> float:
    return float(os.environ.get("RDMA_NETNS_DEBIAN_MAX_AGE_DAYS", "7")) * DAY


def sources() -> list[str]:
    found = [f"deb {MIRROR} {SUITE} main", f"deb {MIRROR} {SUITE}-updates main"]
    if SECURITY_MIRROR:
        found.append(f"deb {SECURITY_MIRROR} {SUITE}-security main")
    return found


@dataclass(frozen=True)
class Recipe:
    """What mmdebstrap is asked for."""
    variant: str                         # minbase, custom, ...
    packages: tuple[str, ...]
    dpkg_options: tuple[str, ...] = ()

    def key(self) -> str:
        what = [RECIPE, SUITE, sources(), self.variant, sorted(self.packages), list(self.dpkg_options)]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RootFacts:
    fetched: float                # when mmdebstrap ran (epoch seconds)
    suites: dict[str, str]        # InRelease file name -> its Date (ISO 8601, UTC)

    def newest(self) -> str:
        """The Date of the newest suite: the packages are as of then."""
        return max(self.suites.values()) if self.suites else ""


def log(message: str) -> None:
    print(f"build-image: {message}", file=sys.stderr, flush=True)


def iso(rfc2822: str) -> str:
    return email.utils.parsedate_to_datetime(rfc2822).strftime("%Y-%m-%dT%H:%M:%SZ")


def cached(meta: Path, now: float, max_age: float) -> RootFacts | None:
    """The facts of a cached root still young enough to use (None: absent, unreadable, or expired)."""
    try:
        data = json.loads(meta.read_text())
        facts = RootFacts(float(data["fetched"]), dict(data["suites"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not 0 <= now - facts.fetched < max_age:
        return None
    return facts


def fetch(recipe: Recipe, tarball: Path, meta: Path) -> RootFacts:
    """Run mmdebstrap into `tarball`; record when, and each suite's InRelease Date, in `meta`."""
    log(f"mmdebstrap {SUITE} {recipe.variant} {' '.join(recipe.packages) or '(nothing else)'}")
    tmp = tarball.with_name(f".{tarball.name}.tmp")
    dates = tarball.with_name(f".{tarball.name}.dates")
    hook = ('for f in "$1"/var/lib/apt/lists/*_InRelease; do '
            'printf "%s\\t%s\\n" "${f##*/}" "$(sed -n "s/^Date: //p" "$f")"; done > ' + shlex.quote(str(dates)))
    argv = ["mmdebstrap", "--quiet", f"--variant={recipe.variant}", "--skip=output/dev", "--format=tar",
            f"--customize-hook={hook}", *[f"--dpkgopt={o}" for o in recipe.dpkg_options]]
    if recipe.packages:
        argv.append("--include=" + ",".join(recipe.packages))
    fetched = time.time()
    subprocess.run([*argv, SUITE, str(tmp), *sources()], check=True)
    suites = {}
    for line in dates.read_text().splitlines():
        name, _, date = line.partition("\t")
        suites[name.removesuffix("_InRelease").rsplit("_dists_", 1)[-1]] = iso(date)  # the suite
    dates.unlink()
    tmp.replace(tarball)
    facts = RootFacts(fetched, suites)
    meta.write_text(json.dumps({"fetched": facts.fetched, "suites": facts.suites}, indent=1) + "\n")
    return facts


def root(cache: Path, recipe: Recipe, into: Path, now: float | None = None) -> RootFacts:
    """The root `recipe` describes, extracted into `into`: from the cache while it is younger than
    the maximum age, fetched again otherwise."""
    tarball = cache / f"root-{SUITE}-{recipe.key()}.tar"
    meta = tarball.with_suffix(".json")
    now = time.time() if now is None else now
    facts = cached(meta, now, max_age_seconds()) if tarball.exists() else None
    if facts is None:
        facts = fetch(recipe, tarball, meta)
    else:
        log(f"cached Debian root {tarball.name}, fetched {(now - facts.fetched) / DAY:.1f} days ago")
    into.mkdir(parents=True)
    with tarfile.open(tarball) as tar:  # our own mmdebstrap output: device nodes were skipped
        kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        tar.extractall(into, numeric_owner=True, **kw)
    return facts
