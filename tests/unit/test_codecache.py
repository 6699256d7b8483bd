"""The hot path's code cache (codecache.py): modules come from it while their sources are
unchanged, the ordinary way once a source changes, and a broken or foreign file changes nothing."""

from __future__ import annotations

import marshal
import re
import shutil
import subprocess
import sys
from pathlib import Path

import rdma_netns
from rdma_netns import codecache

INSTALLED = Path(rdma_netns.__file__).resolve().parent

PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from rdma_netns import codecache
used = codecache.use(sys.argv[2])
import rdma_netns.entry, rdma_netns.commands.add, rdma_netns.spec.versions as v
kind = lambda name: type(sys.modules[name].__spec__.loader).__name__
print(used, kind("rdma_netns.entry"), kind("rdma_netns.commands.add"), kind("rdma_netns.spec.versions"),
      getattr(v, "MARK", "-"), sys.modules["rdma_netns.entry"].__file__)
"""


def copy_package(tmp_path: Path) -> Path:
    packages = tmp_path / "site"
    shutil.copytree(INSTALLED, packages / "rdma_netns", ignore=shutil.ignore_patterns("__pycache__"))
    return packages


def probe(packages: Path, cache: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-IS", "-c", PROBE, str(packages), str(cache)], check=True,
                         capture_output=True, text=True).stdout
    return out.split()


def test_hot_modules_come_from_the_cache(tmp_path):
    packages = copy_package(tmp_path)
    count = codecache.build(str(packages))
    cache = Path(codecache.path_for(str(packages)))
    assert count > 30 and cache.stat().st_mode & 0o777 == 0o644
    used, entry, add, versions, mark, entry_file = probe(packages, cache)
    assert (used, entry, add, versions, mark) == ("True", "Finder", "Finder", "Finder", "-")
    assert entry_file == str(packages / "rdma_netns" / "entry.py")  # tracebacks name the real source


def test_a_changed_source_is_imported_the_ordinary_way(tmp_path):
    packages = copy_package(tmp_path)
    codecache.build(str(packages))
    with open(packages / "rdma_netns" / "spec" / "versions.py", "a") as f:
        f.write("\nMARK = 'fresh'\n")  # an upgrade in place, no new launcher
    used, entry, _add, versions, mark, _ = probe(packages, Path(codecache.path_for(str(packages))))
    assert (used, entry, versions, mark) == ("True", "Finder", "SourceFileLoader", "fresh")


def _framed(index: object) -> bytes:
    data = marshal.dumps(index)
    return len(data).to_bytes(codecache.HEAD, "big") + data


def test_a_broken_or_foreign_cache_changes_nothing(tmp_path):
    packages = copy_package(tmp_path)
    cache = tmp_path / "c.bundle"
    for content in (b"garbage", _framed((codecache.FORMAT, "cpython-00", {})), _framed((1, "x", {})), b"",
                    (10**9).to_bytes(codecache.HEAD, "big")):
        cache.write_bytes(content)
        assert probe(packages, cache)[:4] == ["False", "SourceFileLoader", "SourceFileLoader", "SourceFileLoader"]
    assert probe(packages, tmp_path / "absent")[0] == "False"


def test_a_cache_cut_short_serves_what_it_still_has_and_no_more(tmp_path):
    packages = copy_package(tmp_path)
    codecache.build(str(packages))
    cache = Path(codecache.path_for(str(packages)))
    data = cache.read_bytes()
    cache.write_bytes(data[:len(data) // 2])  # a disk full while it was written, say
    used, entry, add, versions, _mark, _ = probe(packages, cache)
    assert used == "True" and "SourceFileLoader" in (entry, add, versions)  # the tail: the ordinary way


def test_only_the_index_is_read_up_front(tmp_path):
    packages = copy_package(tmp_path)
    codecache.build(str(packages))
    cache = Path(codecache.path_for(str(packages)))
    length = int.from_bytes(cache.read_bytes()[:codecache.HEAD], "big")
    assert codecache.HEAD + length <= codecache.FIRST_READ < cache.stat().st_size // 4


def test_install_launcher_writes_the_cache_and_the_launcher_uses_it(tmp_path):
    from rdma_netns.admin import launcher

    dest = tmp_path / "rdma-netns"
    assert launcher.install(str(dest)) is None
    text = dest.read_text()
    assert f"codecache.use({codecache.path_for(launcher.packages_folder())!r})" in text
    assert Path(codecache.path_for(launcher.packages_folder())).is_file()


def test_the_cached_code_has_no_docstrings_and_the_hot_path_needs_none(tmp_path):
    packages = copy_package(tmp_path)
    codecache.build(str(packages))
    script = PROBE.replace("print(", "print(rdma_netns.entry.main.__doc__, ")
    out = subprocess.run([sys.executable, "-IS", "-c", script, str(packages), codecache.path_for(str(packages))],
                         check=True, capture_output=True, text=True).stdout.split()
    assert out[:2] == ["None", "True"]
    ours = [origin for name, _pkg, origin in codecache.hot_modules(str(packages)) if name.startswith("rdma_netns")]
    assert len(ours) > 30
    for origin in ours:  # optimize=2 drops them: nothing on the hot path may rely on asserts or docstrings
        text = Path(origin).read_text()
        assert not re.search(r"^\s*assert\b", text, re.M) and "__doc__" not in text, origin
