"""CNI spec versions the plugin speaks, and the result format of each."""

from __future__ import annotations

from rdma_netns.spec.errors import INCOMPATIBLE_VERSION, CniError

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST = SUPPORTED_VERSIONS[-1]


def parse(version: str) -> tuple[int, int, int]:
    """'1.0.0' -> (1, 0, 0); anything else is an incompatible-version error."""
    parts = version.split(".") if isinstance(version, str) else []
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise CniError(INCOMPATIBLE_VERSION, f"invalid cniVersion {version!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def require_supported(version: str) -> str:
    parse(version)
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            INCOMPATIBLE_VERSION,
            f"incompatible CNI version {version}",
            f"this plugin supports {', '.join(SUPPORTED_VERSIONS)}",
        )
    return version


def at_least(version: str, minimum: str) -> bool:
    return parse(version) >= parse(minimum)


def version_result() -> dict:
    """What VERSION prints."""
    return {"cniVersion": LATEST, "supportedVersions": list(SUPPORTED_VERSIONS)}


def format_result(result: dict, version: str) -> dict:
    """Render a result built in 1.x form in the config's cniVersion.

    0.3.x and 0.4.0 results differ from 1.x only by the per-IP "version" field.
    """
    out = {"cniVersion": version}
    out.update({k: v for k, v in result.items() if k != "cniVersion"})
    if parse(version) < (1, 1, 0):  # interface fields added in 1.1.0
        out["interfaces"] = [{k: v for k, v in i.items() if k not in ("pciID", "mtu", "socketPath")}
                             for i in result.get("interfaces", [])]
    if parse(version) < (1, 0, 0):
        out["ips"] = [
            {"version": "6" if ":" in ip["address"] else "4", **ip} for ip in result.get("ips", [])
        ]
    else:
        out["ips"] = [{k: v for k, v in ip.items() if k != "version"} for ip in result.get("ips", [])]
    return out
