"""Per-interface IPv6 sysctls, written through /proc/sys in the current network namespace."""

from __future__ import annotations


def set_ipv6_conf(ifname: str, key: str, value: str) -> None:
    # The ifname was validated (no '/', not '.' or '..'), so the path stays inside conf/.
    with open(f"/proc/sys/net/ipv6/conf/{ifname}/{key}", "w") as f:
        f.write(value)


def get_ipv6_conf(ifname: str, key: str) -> str:
    with open(f"/proc/sys/net/ipv6/conf/{ifname}/{key}") as f:
        return f.read().strip()
