"""util/paths.py answers as posixpath does (the hot path uses it instead of os.path, see its docstring)."""

from __future__ import annotations

import os
import posixpath
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from rdma_netns.util import paths

PIECES = st.text(alphabet="/ab.", max_size=12)


@settings(max_examples=examples(400), deadline=None)
@given(PIECES, st.lists(PIECES, max_size=3))
def test_join_dirname_basename_are_posixpaths(first, rest):
    assert paths.join(first, *rest) == posixpath.join(first, *rest)
    assert paths.dirname(first) == posixpath.dirname(first)
    assert paths.basename(first) == posixpath.basename(first)


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link-to-folder").symlink_to(tmp_path / "folder")
    (tmp_path / "dangling").symlink_to(tmp_path / "absent")
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


@pytest.mark.parametrize("name", ["folder", "file", "link-to-folder", "dangling", "fifo", "absent", "file/below", ""])
def test_file_kinds_are_posixpaths(tree, name):
    path = str(tree / name) if name else ""
    for check in ("exists", "lexists", "isdir", "isfile", "islink"):
        assert getattr(paths, check)(path) == getattr(posixpath, check)(path), (check, name)


def test_a_nul_in_a_path_is_no_file(tree):
    assert not paths.exists(f"{tree}/fi\0le") and not paths.isfile(f"{tree}/fi\0le")


def test_makedirs_makes_what_is_missing_with_os_makedirs_modes(tmp_path):
    old = os.umask(0o022)
    try:
        leaf = tmp_path / "a" / "b" / "c"
        paths.makedirs(str(leaf), 0o700)
        assert stat.S_IMODE(leaf.stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755  # 0o777 less the umask, as os.makedirs
        paths.makedirs(str(leaf), 0o700)  # there already: nothing to do
        paths.makedirs(str(leaf) + "/", 0o700)
    finally:
        os.umask(old)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(FileExistsError):
        paths.makedirs(str(tmp_path / "plain"))
    for makedirs in (paths.makedirs, lambda path: os.makedirs(path, exist_ok=True)):
        with pytest.raises(NotADirectoryError):
            makedirs(str(tmp_path / "plain" / "below"))
