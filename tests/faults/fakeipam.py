"""A fake IPAM plugin for fault tests: Debian's host-local, unless a control file says to
misbehave for one CNI command (<ctl>/<behaviour>-<COMMAND>):

hang (sleeps 30 s), slow (sleeps 1.5 s, then host-local), fail (a CNI error JSON, exit 1),
garbage (not JSON, exit 0), noip (a result without addresses), kill (SIGKILLs itself).
Every invocation appends its pid and command to <ctl>/calls.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import CNI_BIN_DIR
from tests.faults.helpers import write_script

NAME = "fake-ipam"

SCRIPT = """ctl={ctl}
on() {{ [ -e "$ctl/$1-$CNI_COMMAND" ] || [ -e "$ctl/$1-$CNI_COMMAND-$CNI_IFNAME" ]; }}
echo "$$ $CNI_COMMAND $CNI_IFNAME" >> $ctl/calls
if on hang; then exec sleep 30; fi
if on slow; then sleep 1.5; fi
if on fail; then
  echo '{{"cniVersion":"1.0.0","code":11,"msg":"fake ipam says no","details":"by request"}}'; exit 1; fi
if on garbage; then echo 'this is not json'; exit 0; fi
if on noip; then echo '{{"cniVersion":"1.0.0","ips":[]}}'; exit 0; fi
if on kill; then kill -9 $$; fi
exec {host_local}
"""


class FakeIpam:
    def __init__(self, base: Path) -> None:
        self.bin = base / "cni-bin"
        self.ctl = base / "ipam-ctl"
        self.ctl.mkdir(parents=True, exist_ok=True)
        write_script(self.bin, NAME, SCRIPT.format(ctl=self.ctl, host_local=f"{CNI_BIN_DIR}/host-local"))

    @property
    def cni_path(self) -> str:
        return f"{self.bin}:{CNI_BIN_DIR}"

    def set(self, behaviour: str, command: str = "ADD", ifname: str | None = None) -> None:
        """Misbehave for `command` (only for the rail interface `ifname` when given)."""
        (self.ctl / (f"{behaviour}-{command}" + (f"-{ifname}" if ifname else ""))).touch()

    def clear(self) -> None:
        for f in self.ctl.iterdir():
            if f.name != "calls":
                f.unlink()

    def calls(self) -> list[tuple[int, str, str]]:
        path = self.ctl / "calls"
        if not path.exists():
            return []
        return [(int(p), c, i) for p, c, i in (line.split() for line in path.read_text().splitlines())]


def use_fake(node, conf: dict, rails: tuple[int, ...] = (0,)) -> dict:
    """Point the given rails of `conf` at the fake IPAM (same host-local settings)."""
    for i in rails:
        conf["rails"][i]["ipam"]["type"] = NAME
    return conf
