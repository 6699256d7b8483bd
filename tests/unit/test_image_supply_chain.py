"""The image's supply chain (imagebuild/): the Python lock with hashes that the build installs
with --require-hashes, the Debian roots' cache that expires, and the SBOM. The deploy suite
(integration/deploy) checks the same in an image really built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from imagebuild import debian, lock, release, sbom


def test_every_dependency_is_locked_within_its_range_with_a_hash():
    entries = {e.name: e for e in lock.read()}
    assert entries, "imagebuild/requirements.lock is empty"
    for entry in entries.values():
        assert entry.hashes, f"{entry.name}=={entry.version} has no --hash: pip --require-hashes refuses it"
        assert all(len(h) == 64 for h in entry.hashes)
    for dependency in lock.dependencies():
        wanted = Requirement(dependency)
        entry = entries.get(lock.normalize(wanted.name))
        assert entry, f"pyproject.toml's {dependency!r} is not in the lock: run scripts/lock-image-deps.sh"
        assert wanted.specifier.contains(entry.version, prereleases=True), (
            f"the lock's {entry.name}=={entry.version} is outside pyproject.toml's {dependency!r}: "
            "run scripts/lock-image-deps.sh")


def test_a_lock_line_without_its_hash_or_garbage_is_refused(tmp_path: Path):
    path = tmp_path / "requirements.lock"
    path.write_text("# c\ngrpcio==1.85.4 \\\n    --hash=sha256:" + "a" * 64 + "\npyyaml==6.0.4\n")
    entries = lock.read(path)
    assert [(e.name, e.hashes) for e in entries] == [("grpcio", ("a" * 64,)), ("pyyaml", ())]
    path.write_text("grpcio>=1\n")
    with pytest.raises(ValueError, match="not a pin or a hash"):
        lock.read(path)


def test_the_build_installs_the_lock_with_require_hashes():
    """The install step's pip arguments (release.py): the lock with --require-hashes and --no-deps,
    never a name for pip to resolve from an index."""
    source = Path(release.__file__).read_text()
    install = source[source.index('run(*pip, "install"'):source.index('run(*pip, "check"')]
    assert '"--require-hashes"' in install and "LOCK_NAME" in install and '"--no-index"' in install
    main = Path(release.__file__).with_name("__main__.py").read_text()
    assert '"--require-hashes"' in main[main.index("def wheels"):main.index("def git_commit")]


def test_a_cached_root_expires(tmp_path: Path, monkeypatch):
    meta = tmp_path / "root.json"
    assert debian.cached(meta, 1000.0, 7 * debian.DAY) is None  # absent
    meta.write_text(json.dumps({"fetched": 1000.0, "suites": {"bookworm": "2026-12-05T03:33:28Z"}}))
    facts = debian.cached(meta, 1000.0 + 6.9 * debian.DAY, 7 * debian.DAY)
    assert facts and facts.newest() == "2026-12-05T03:33:28Z"
    assert debian.cached(meta, 1000.0 + 7 * debian.DAY, 7 * debian.DAY) is None, "older than the maximum age"
    assert debian.cached(meta, 900.0, 7 * debian.DAY) is None, "fetched in the future: the clock moved"
    monkeypatch.setenv("RDMA_NETNS_DEBIAN_MAX_AGE_DAYS", "0")
    assert debian.cached(meta, 1000.0, debian.max_age_seconds()) is None, "0 days: fetched every time"
    meta.write_text("{")
    assert debian.cached(meta, 1000.0, 7 * debian.DAY) is None


def test_a_root_from_an_expired_cache_is_fetched_again(tmp_path: Path, monkeypatch):
    """root(): a young tarball is used as is, an old one is fetched again (mmdebstrap stood in)."""
    import tarfile

    calls = []

    def fake_fetch(recipe, tarball, meta):
        calls.append(tarball.name)
        with tarfile.open(tarball, "w") as tar:
            tar.add(__file__, arcname="etc/marker")
        facts = debian.RootFacts(now[0], {"bookworm": "2026-12-05T03:33:28Z"})
        meta.write_text(json.dumps({"fetched": facts.fetched, "suites": facts.suites}))
        return facts

    monkeypatch.setattr(debian, "fetch", fake_fetch)
    recipe = debian.Recipe("custom", ("dash",))
    now = [10 * debian.DAY]
    debian.root(tmp_path, recipe, tmp_path / "a", now=now[0])
    debian.root(tmp_path, recipe, tmp_path / "b", now=now[0] + debian.DAY)
    assert len(calls) == 1, "a day-old root comes from the cache"
    now[0] += 8 * debian.DAY
    debian.root(tmp_path, recipe, tmp_path / "c", now=now[0])
    assert len(calls) == 2, "an 8-day-old root is fetched again"
    assert (tmp_path / "c/etc/marker").exists()
    assert debian.Recipe("custom", ("dash", "sed")).key() != recipe.key()


def test_the_security_suite_is_a_source(monkeypatch):
    assert any(s.endswith(f"{debian.SUITE}-security main") for s in debian.sources())
    assert any(s.endswith(f"{debian.SUITE}-updates main") for s in debian.sources())


def fake_debian_root(root: Path, packages: dict[str, list[str]]) -> None:
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True)
    stanzas = []
    for name, files in packages.items():
        stanzas.append(f"Package: {name}\nStatus: install ok installed\nArchitecture: amd64\n"
                       f"Version: 1:2.36-9\nSource: {name}-src (1)\nDescription: x\n more\n")
        (info / f"{name}:amd64.list").write_text("\n".join(files) + "\n")
        for f in files:
            (root / f.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / f.lstrip("/")).write_bytes(name.encode())
    (root / "var/lib/dpkg/status").write_text("\n".join(stanzas))


def test_the_sbom_covers_the_debian_packages_and_the_release_folder(tmp_path: Path):
    image_root, build_root, rel = tmp_path / "image", tmp_path / "build", tmp_path / "release"
    fake_debian_root(image_root, {"dash": ["/bin/dash"], "coreutils": ["/bin/cat"]})
    fake_debian_root(build_root, {"libc6": ["/lib/x86_64-linux-gnu/libc.so.6"],
                                  "python3.11-minimal": ["/usr/bin/python3.11"],
                                  "libpython3.11-stdlib": ["/usr/lib/python3.11/json/__init__.py"]})
    for path, data in {"python/bin/python3.11": b"patched", "python/lib/libc.so.6": b"libc",
                       "python/lib/python3.11/json/__init__.py": b"", "venv/lib/python3.11/site-packages/"
                       "grpcio-1.85.4.dist-info/METADATA": b"Name: grpcio\nVersion: 1.85.4\nLicense: Apache-2.0\n"}.items():
        (rel / path).parent.mkdir(parents=True, exist_ok=True)
        (rel / path).write_bytes(data)
    origins = {"python/bin/python3.11": "/usr/bin/python3.11",
               "python/lib/libc.so.6": "/usr/lib/x86_64-linux-gnu/libc.so.6",  # merged /usr spelling
               "python/lib/python3.11/json/__init__.py": "/usr/lib/python3.11/json/__init__.py"}
    roots = {"image-root": debian.RootFacts(0.0, {"bookworm": "2026-12-05T03:33:28Z"})}
    doc = sbom.build(image_root=image_root, build_root=build_root, release_dir=rel, release_path="/opt/r/R",
                     origins=origins, wheel_hashes={"grpcio": "b" * 64}, release="R",
                     created="2026-12-07T00:00:00Z", roots=roots)
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.5"
    by_name = {c["name"]: c for c in doc["components"]}
    assert {"dash", "coreutils", "libc6", "python3.11-minimal", "libpython3.11-stdlib", "grpcio"} <= set(by_name)
    assert by_name["libc6"]["purl"] == "pkg:deb/debian/libc6@1%3A2.36-9?arch=amd64&distro=debian-12"
    assert {"location": "/opt/r/R/python/lib/libc.so.6"} in by_name["libc6"]["evidence"]["occurrences"]
    assert by_name["grpcio"]["hashes"] == [{"alg": "SHA-256", "content": "b" * 64}]
    interpreter = by_name["/opt/r/R/python/bin/python3.11"]
    assert interpreter["type"] == "file" and interpreter["hashes"][0]["content"] == sbom.sha256(rel / "python/bin/python3.11")
    assert {"name": "rdma-netns:debian:image-root:bookworm", "value": "2026-12-05T03:33:28Z"} in doc["metadata"]["properties"]
    with pytest.raises(RuntimeError, match="no Debian package"):
        sbom.build(image_root=image_root, build_root=build_root, release_dir=rel, release_path="/opt/r/R",
                   origins={**origins, "python/lib/libx.so": "/usr/lib/libx.so"}, wheel_hashes={},
                   release="R", created="x", roots=roots)
