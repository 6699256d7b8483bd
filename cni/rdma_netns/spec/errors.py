"""CNI errors: the spec's codes, rendered as the JSON a runtime expects on stdout."""

from __future__ import annotations

# Codes from the CNI spec (1.0.0 / 1.1.0, "Error" section).
INCOMPATIBLE_VERSION = 1
UNSUPPORTED_FIELD = 2
UNKNOWN_CONTAINER = 3
INVALID_ENV = 4
IO_FAILURE = 5
DECODE_FAILURE = 6
INVALID_CONFIG = 7
TRY_AGAIN_LATER = 11
NOT_AVAILABLE = 50          # STATUS: the plugin cannot take ADDs now
LIMITED_CONNECTIVITY = 51   # STATUS: ... and existing pods may suffer too

# The plugin's own codes (100 and up).
KERNEL_REJECTED = 100       # a netlink request failed
RAIL_UNAVAILABLE = 101      # a rail's netdev or RDMA device is missing or unusable
IFNAME_EXISTS = 102         # the pod already has an interface of that name
WRONG_RDMA_MODE = 103       # kernel RDMA netns mode does not fit the config's mode
NO_RDMA = 104               # no RDMA subsystem, no RDMA device for a rail, or no GID appeared
IPAM_FAILED = 105           # the IPAM delegate failed or returned something unusable
CHECK_FAILED = 106          # CHECK found a difference from what ADD set up
PAIRING_UNAVAILABLE = 107   # kubelet's PodResources could not say what the pod was granted
NOT_GRANTED = 108           # the pod holds no device of resourceName that this network can attach
NO_NODE_RANGE = 109         # rangeFromNodeAddress: the rail's node address gives no pod range (none, several, too small)


class CniError(Exception):
    """An error the plugin reports to the runtime (never a traceback)."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details

    def to_json_dict(self, cni_version: str) -> dict:
        out: dict = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out
