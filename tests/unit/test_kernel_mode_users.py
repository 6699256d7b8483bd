"""The device plugin and the admin tool apply the one kernel-mode rule (mode_policy) and write
their files through the one atomic writer with the modes their readers need."""

from __future__ import annotations

import os
import stat

from rdma_netns import mode_policy
from rdma_netns.admin import mode as admin_mode
from rdma_netns.kernel.rdma_sysfs import RdmaSysfs
from rdma_netns_dp import cdi, kernel_mode
from tests.fake_rdma_sysfs import FakeRdmaSysfs


def test_device_plugin_follows_mode_policy(tmp_path):
    fake = FakeRdmaSysfs(tmp_path, netns_mode="N")
    sysfs = RdmaSysfs(str(fake.sys))
    assert kernel_mode.resolve("auto", sysfs) == mode_policy.resolve("auto", "exclusive") == "exclusive"
    assert kernel_mode.mismatch("exclusive", sysfs) is None
    why = kernel_mode.mismatch("shared", sysfs)
    assert why.startswith(mode_policy.mismatch("shared", "exclusive"))
    assert mode_policy.fix_hint("shared") in why and "--ensure-kernel-mode" in why
    fake.set_netns_mode(None)  # no RDMA core: plain netdevs work in either mode
    assert kernel_mode.resolve("auto", sysfs) == "shared" and kernel_mode.mismatch("exclusive", sysfs) is None


def test_persisted_mode_is_world_readable_and_round_trips(tmp_path):
    path = str(tmp_path / "rdma-netns.conf")
    old = os.umask(0o077)  # even under a strict umask modprobe must be able to read it
    try:
        admin_mode.persist("exclusive", path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert "options ib_core netns_mode=0" in open(path).read()
    assert admin_mode.persisted_mode(path) == "exclusive"
    admin_mode.persist("shared", path)
    assert admin_mode.persisted_mode(path) == "shared"
    assert os.listdir(tmp_path) == ["rdma-netns.conf"]  # no temp file left


def test_cdi_spec_is_world_readable(tmp_path):
    spec_dir = str(tmp_path / "cdi")
    assert cdi.write_spec(spec_dir, "rdma_hca", {"cdiVersion": "0.6.0", "devices": []})
    assert not cdi.write_spec(spec_dir, "rdma_hca", {"cdiVersion": "0.6.0", "devices": []})  # unchanged
    path = cdi.spec_path(spec_dir, "rdma_hca")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644 and os.listdir(spec_dir) == [os.path.basename(path)]
