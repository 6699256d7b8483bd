"""The rule for paths a config names (cni/rdma_netns/util/trusted_paths.py), case by case, as root."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rdma_netns.util import trusted_paths
from rdma_netns.util.trusted_paths import Untrusted

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="owners and modes of other users need root")


@pytest.fixture(autouse=True)
def fresh():
    trusted_paths.forget()
    yield
    trusted_paths.forget()


def folder(path: Path, mode: int = 0o700, uid: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    os.chown(path, uid, 0)
    return path


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_tests_own_temp_folders_pass(tmp_path):
    """pytest's and mktemp's folders are 0700 root below the sticky /tmp: usable as they are."""
    assert mode_of(Path("/tmp")) & stat.S_ISVTX
    assert trusted_paths.check_folder(str(tmp_path)) is True
    assert trusted_paths.check_folder(str(tmp_path / "missing" / "deeper")) is False


@pytest.mark.parametrize("mode,uid,why", [
    (0o1777, 0, "sticky"), (0o777, 0, "writable by group or others"), (0o770, 0, "writable by group or others"),
    (0o1755, 0, "sticky"), (0o700, NOBODY, "belongs to uid 65534"),
])
def test_the_named_folder(tmp_path, mode, uid, why):
    named = folder(tmp_path / "named", mode, uid)
    with pytest.raises(Untrusted, match=why):
        trusted_paths.check_folder(str(named))
    with pytest.raises(Untrusted, match=why):
        trusted_paths.make_folder(str(named), 0o700)
    assert mode_of(named) == mode and os.lstat(named).st_uid == uid


@pytest.mark.parametrize("mode,uid,ok", [
    (0o1777, 0, True),     # sticky, like /tmp: root's entries in it cannot be moved by others
    (0o755, 0, True),
    (0o777, 0, False),     # anyone could swap what is below it
    (0o775, 0, False),
    (0o755, NOBODY, False),  # its owner could swap what is below it
])
def test_a_folder_on_the_way(tmp_path, mode, uid, ok):
    parent = folder(tmp_path / "parent", mode, uid)
    named = folder(parent / "named", 0o700)
    if ok:
        assert trusted_paths.check_folder(str(named)) is True
        assert trusted_paths.check_folder(str(parent / "missing")) is False
    else:
        with pytest.raises(Untrusted, match=str(parent)):
            trusted_paths.check_folder(str(named))
        with pytest.raises(Untrusted):
            trusted_paths.check_folder(str(parent / "missing"))  # missing changes nothing: the way is refused


def test_symlinks_on_the_way_are_followed_when_root_owns_them(tmp_path):
    """/var/run -> /run: the default cdiSpecDir goes through one."""
    real = folder(tmp_path / "real")
    named = folder(real / "named")
    (tmp_path / "link").symlink_to("real")  # relative, as /var/run's is
    assert trusted_paths.check_folder(str(tmp_path / "link" / "named")) is True
    (tmp_path / "abs").symlink_to(real)
    assert trusted_paths.check_folder(str(tmp_path / "abs" / "named")) is True
    (tmp_path / "up").symlink_to("real/../real")
    assert trusted_paths.check_folder(str(tmp_path / "up" / "named")) is True
    assert named.is_dir()


def test_a_symlink_somebody_else_owns_is_refused(tmp_path):
    """In a sticky folder, the owner of a symlink can point it elsewhere at any time."""
    sticky = folder(tmp_path / "sticky", 0o1777)
    real = folder(tmp_path / "real")
    folder(real / "named")
    (sticky / "link").symlink_to(real)
    os.lchown(sticky / "link", NOBODY, NOBODY)
    with pytest.raises(Untrusted, match="symlink that belongs to uid 65534"):
        trusted_paths.check_folder(str(sticky / "link" / "named"))


def test_the_named_folder_is_not_a_symlink(tmp_path):
    real = folder(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(Untrusted, match="symlink"):
        trusted_paths.check_folder(str(tmp_path / "link"))
    with pytest.raises(Untrusted, match="symlink"):
        trusted_paths.make_folder(str(tmp_path / "link"), 0o700)


def test_a_symlink_loop_is_refused(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(Untrusted, match="symlinks"):
        trusted_paths.check_folder(str(tmp_path / "a" / "x"))


def test_a_file_on_the_way_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(Untrusted, match="regular file, not a folder"):
        trusted_paths.check_folder(str(tmp_path / "file" / "x"))


def test_made_folders_get_the_mode_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        trusted_paths.make_folder(str(tmp_path / "a" / "b" / "c"), 0o700)
    finally:
        os.umask(old)
    assert [mode_of(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    old = os.umask(0o077)
    try:
        trusted_paths.make_folder(str(tmp_path / "pub" / "lic"), 0o755)
    finally:
        os.umask(old)
    assert mode_of(tmp_path / "pub") == mode_of(tmp_path / "pub" / "lic") == 0o755


def test_an_existing_folder_keeps_its_mode(tmp_path):
    for mode in (0o755, 0o750, 0o500, 0o711):
        named = folder(tmp_path / f"m{mode:o}", mode)
        trusted_paths.make_folder(str(named), 0o700)
        assert mode_of(named) == mode


def test_a_folder_somebody_else_made_first_is_checked(tmp_path, monkeypatch):
    """mkdir losing a race in a sticky folder: the winner's folder is checked, not adopted."""
    sticky = folder(tmp_path / "sticky", 0o1777)
    real_mkdir = trusted_paths.posix.mkdir

    def racing_mkdir(path, mode=0o777):
        os.mkdir(path, 0o700)
        os.chown(path, NOBODY, NOBODY)
        real_mkdir(path, mode)  # EEXIST, as a lost race

    monkeypatch.setattr(trusted_paths.posix, "mkdir", racing_mkdir)
    with pytest.raises(Untrusted, match="uid 65534"):
        trusted_paths.make_folder(str(sticky / "state"), 0o700)
    assert mode_of(sticky / "state") == 0o700 and os.lstat(sticky / "state").st_uid == NOBODY


def test_the_fifo(tmp_path):
    run = folder(tmp_path / "run")
    fifo = run / "cni-events"
    assert trusted_paths.check_fifo(str(fifo)) is None
    os.mkfifo(fifo, 0o600)
    assert trusted_paths.check_fifo(str(fifo)).st_ino == os.lstat(fifo).st_ino
    os.chmod(fifo, 0o622)
    trusted_paths.forget()  # what passed is not looked at again by the same process (root alone can change it)
    with pytest.raises(Untrusted, match="mode 622"):
        trusted_paths.check_fifo(str(fifo))
    os.chmod(fifo, 0o600)
    os.chown(fifo, NOBODY, 0)
    trusted_paths.forget()
    with pytest.raises(Untrusted, match="uid 65534"):
        trusted_paths.check_fifo(str(fifo))
    device = run / "watchdog"
    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    with pytest.raises(Untrusted, match="character device, not the FIFO"):
        trusted_paths.check_fifo(str(device))
    (run / "link").symlink_to(device)
    with pytest.raises(Untrusted, match="symlink, not the FIFO"):
        trusted_paths.check_fifo(str(run / "link"))
    (run / "file").write_text("")
    with pytest.raises(Untrusted, match="regular file"):
        trusted_paths.check_fifo(str(run / "file"))


def test_what_passed_is_not_looked_at_again(tmp_path, monkeypatch):
    """One CNI call checks stateDir at load and again when it makes its folders: once is enough."""
    named = folder(tmp_path / "state")
    assert trusted_paths.check_folder(str(named))
    monkeypatch.setattr(trusted_paths.posix, "lstat", lambda *a: pytest.fail("looked at again"))
    assert trusted_paths.check_folder(str(named))
    trusted_paths.make_folder(str(named), 0o700)


def test_relative_paths_are_refused():
    with pytest.raises(Untrusted, match="not an absolute path"):
        trusted_paths.check_folder("var/lib")
