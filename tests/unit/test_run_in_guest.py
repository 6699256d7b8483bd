"""run-in-guest.sh's boot handling, with a stand-in `vng` that plays the guest on this machine:
a guest that dies before the command starts is booted again (its console kept), a command that
started is never run twice, and every give-up says why with the spec'd exit code."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "integration" / "guest" / "run-in-guest.sh"

# Dies (exit 255, as vng does when qemu ends without the script's return code) for the first
# $FAKE_DEATHS boots, then runs the --exec command here, as the guest would.
FAKE_VNG = r"""#!/bin/bash
count=$(( $(cat "$FAKE_STATE/boots" 2>/dev/null || echo 0) + 1 ))
echo "$count" > "$FAKE_STATE/boots"
printf '%s\n' "$@" > "$FAKE_STATE/args.$count"
if [ "$count" -le "$FAKE_DEATHS" ]; then
    echo "Kernel panic - not syncing: boot $count"
    exit 255
fi
# a guest whose command was killed ends without a return code: vng says 255
while [ $# -gt 0 ]; do [ "$1" = --exec ] && { bash -c "$2"; rc=$?; [ $rc -lt 128 ] || rc=255; exit $rc; }; shift; done
exit 1
"""


def run(tmp_path: Path, deaths: int, *extra: str, command: str = "echo ran >> $GUEST_RESULTS/runs; exit 3"):
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    vng = bin_dir / "vng"
    vng.write_text(FAKE_VNG)
    (bin_dir / "qemu-system-x86_64").write_text("#!/bin/sh\nexit 0\n")
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    kernel = tmp_path / "vmlinuz"
    kernel.write_text("not a kernel")
    results = tmp_path / "results"
    env = dict(os.environ, KERNEL=str(kernel), VNG=str(vng), FAKE_STATE=str(state), FAKE_DEATHS=str(deaths),
               RDMA_NETNS_KERNEL_CACHE=str(tmp_path / "no-cache"), PATH=f"{bin_dir}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(SCRIPT), "--timeout", "60", *extra, "--results", str(results), "--",
                           "bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)
    return proc, results, state


def test_a_guest_that_died_before_the_command_is_booted_again_and_its_console_kept(tmp_path):
    proc, results, state = run(tmp_path, deaths=1)
    assert proc.returncode == 3, proc.stderr  # the command's own exit code
    assert (state / "boots").read_text().strip() == "2"
    assert (results / "runs").read_text() == "ran\n"  # the command ran once
    assert "boot 1" in (results / "console.attempt1.log").read_text()
    assert "boot 1" not in (results / "console.log").read_text()
    assert (results / "boot-attempts").read_text().strip() == "2"
    assert "booting again" in proc.stderr
    assert "--verbose" in (state / "args.1").read_text().split("\n"), "the boot console is always kept"


def test_it_gives_up_after_the_attempts_with_125(tmp_path):
    proc, results, state = run(tmp_path, 5, "--boot-attempts", "2")
    assert proc.returncode == 125
    assert (state / "boots").read_text().strip() == "2"
    assert "failed to boot" in proc.stderr and "attempt 2 of 2" in proc.stderr
    assert not (results / "runs").exists()


def test_one_attempt_means_no_retry(tmp_path):
    proc, _, state = run(tmp_path, 1, "--boot-attempts", "1")
    assert proc.returncode == 125
    assert (state / "boots").read_text().strip() == "1"


def test_a_command_that_started_and_died_is_not_run_again(tmp_path):
    # the guest booted (marker written) and then died without a return code: no second boot
    proc, results, state = run(tmp_path, deaths=0, command="echo ran >> $GUEST_RESULTS/runs; kill -9 $PPID")
    assert proc.returncode == 125, proc.stderr
    assert (state / "boots").read_text().strip() == "1"
    assert (results / "runs").read_text() == "ran\n"
    assert "died before the command finished" in proc.stderr


@pytest.mark.parametrize("value", ["0", "x", "-1"])
def test_bad_attempt_counts_are_usage_errors(tmp_path, value):
    proc, _, _ = run(tmp_path, 0, "--boot-attempts", value)
    assert proc.returncode == 2
