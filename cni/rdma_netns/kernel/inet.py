"""IP addresses and prefixes for the hot path, on the C inet_pton/inet_ntop.

The standard `ipaddress` module (with functools behind it) costs a few milliseconds of import
on every plugin start; the plugin only needs parse, print, mask and compare.
"""

from __future__ import annotations

from _socket import AF_INET, AF_INET6, inet_ntop, inet_pton


class Prefix:
    """An address with a prefix length ("fd00::2/64"); also used for plain addresses (/128, /32)."""

    __slots__ = ("family", "packed", "prefixlen")

    def __init__(self, family: int, packed: bytes, prefixlen: int) -> None:
        self.family = family
        self.packed = packed
        self.prefixlen = prefixlen

    @classmethod
    def parse(cls, text: str, default_len: int | None = None) -> Prefix:
        """'fd00::2/64', '10.0.0.1/24', or a bare address (full length). ValueError if invalid."""
        if not isinstance(text, str):
            raise ValueError(f"{text!r} is not an address")
        addr, sep, length = text.partition("/")
        family = AF_INET6 if ":" in addr else AF_INET
        try:
            packed = inet_pton(family, addr)
        except OSError:
            raise ValueError(f"{text!r} is not an IP address") from None
        bits = len(packed) * 8
        if sep:
            if not length.isdigit() or int(length) > bits:
                raise ValueError(f"{text!r} has an invalid prefix length")
            plen = int(length)
        else:
            plen = bits if default_len is None else default_len
        return cls(family, packed, plen)

    @classmethod
    def from_bytes(cls, packed: bytes, prefixlen: int | None = None) -> Prefix:
        family = AF_INET6 if len(packed) == 16 else AF_INET
        return cls(family, packed, len(packed) * 8 if prefixlen is None else prefixlen)

    @property
    def version(self) -> int:
        return 6 if self.family == AF_INET6 else 4

    @property
    def max_prefixlen(self) -> int:
        return len(self.packed) * 8

    @property
    def ip(self) -> Prefix:
        """The address alone, as a full-length prefix."""
        return Prefix(self.family, self.packed, self.max_prefixlen)

    @property
    def network(self) -> Prefix:
        """The prefix with the host bits cleared ("fd00::2/64" -> "fd00::/64")."""
        bits = self.max_prefixlen
        mask = ((1 << bits) - 1) ^ ((1 << (bits - self.prefixlen)) - 1)
        value = int.from_bytes(self.packed, "big") & mask
        return Prefix(self.family, value.to_bytes(bits // 8, "big"), self.prefixlen)

    def address_text(self) -> str:
        return inet_ntop(self.family, self.packed)

    def exploded(self) -> str:
        """IPv6 in full 4-digit groups, the way sysfs prints a GID."""
        h = self.packed.hex()
        return ":".join(h[i:i + 4] for i in range(0, len(h), 4))

    def __str__(self) -> str:
        return f"{self.address_text()}/{self.prefixlen}"

    def __repr__(self) -> str:
        return f"Prefix({self})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Prefix) and (self.packed, self.prefixlen) == (other.packed, other.prefixlen)

    def __hash__(self) -> int:
        return hash((self.packed, self.prefixlen))
