"""What a pod's containers need to use their own rails: the rails record and the environment.

Pure functions (no I/O): commands/add.py hands in what ADD learnt per rail (interface, addresses with
their prefix length, RDMA device and port, the GID index it waited for) and publish/pod_cdi.py writes the
result. Training frameworks pick one GID index for every HCA (NCCL_IB_GID_INDEX, UCX_IB_GID_INDEX);
in shared mode each pod's GID sits at another index per pod and per NIC, so those are set only
when the pod's index is the same on every rail. Otherwise NCCL's own selection is narrowed to the
pod's addresses (NCCL_IB_ADDR_RANGE, the smallest prefix covering them) and the family, and the
JSON file still lists the truth per rail.
"""

from __future__ import annotations

from _socket import AF_INET, AF_INET6

from rdma_netns.kernel.inet import Prefix
from rdma_netns.kernel.rdma_sysfs import gid_text

VERSION = 1
RAILS_FILE = "/etc/rdma-netns/rails.json"  # where the CDI spec mounts the JSON file in a container
# Where the CDI spec mounts the NCCL settings. NCCL reads /etc/nccl.conf (after NCCL_CONF_FILE or
# ~/.nccl.conf) and applies each NAME=value line with setenv(..., 0): a variable the pod spec sets
# wins. CDI's env edits would replace it instead (the runtime applies them last), so NCCL_* go
# here and only what no framework reads from a file stays in the env edits.
NCCL_CONF = "/etc/nccl.conf"
# Never published: the fabric's QoS and timeouts (NCCL_IB_TC, NCCL_IB_SL, NCCL_IB_TIMEOUT, ...)
# belong to the admin and the job (Lingjun: NCCL_IB_TC=136, NCCL_IB_SL=5).


def rail_entry(ifname: str, netdev: str | None, addresses: list[str], rdma_device: str | None,
               port: int | None, gid_index: int | None) -> dict:
    """One rail of the record. `addresses` are "address/prefixlen" texts; `gid` is the RoCE v2 GID
    of the first one as sysfs prints it (null without an RDMA device or an address)."""
    gid = None
    if rdma_device and addresses:
        gid = gid_text(Prefix.parse(addresses[0]))
    return {"ifname": ifname, "netdev": netdev, "addresses": list(addresses), "rdmaDevice": rdma_device or None,
            "port": port if rdma_device else None, "gidIndex": gid_index if rdma_device else None, "gid": gid}


def gid_indexes_equal(rails: list[dict]) -> bool:
    """True when every rail with an RDMA device has a known GID index and they are all the same."""
    indexes = [r["gidIndex"] for r in rails if r.get("rdmaDevice")]
    return bool(indexes) and None not in indexes and len(set(indexes)) == 1


def covering_prefix(addresses: list[Prefix]) -> Prefix | None:
    """The smallest prefix that holds every address (one family); None when empty or mixed."""
    if not addresses or len({a.family for a in addresses}) != 1:
        return None
    bits = addresses[0].max_prefixlen
    values = [int.from_bytes(a.packed, "big") for a in addresses]
    differ = 0
    for value in values[1:]:
        differ |= value ^ values[0]
    length = bits - differ.bit_length()
    return Prefix.from_bytes(values[0].to_bytes(bits // 8, "big"), length).network


def _hca(rail: dict) -> str:
    return f"{rail['rdmaDevice']}:{rail['port']}" if rail.get("port") else rail["rdmaDevice"]


def environment(rails: list[dict], rails_file: str = RAILS_FILE) -> dict[str, str]:
    """The container environment for these rails (only the keys that apply)."""
    env: dict[str, str] = {}
    if not rails:
        return env
    env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(r["ifname"] for r in rails)
    rdma = [r for r in rails if r.get("rdmaDevice")]
    if rdma:
        hcas = ",".join(_hca(r) for r in rdma)
        env["NCCL_IB_HCA"] = "=" + hcas
        env["UCX_NET_DEVICES"] = hcas
        firsts = [Prefix.parse(r["addresses"][0]) for r in rdma if r.get("addresses")]
        if firsts:
            env["NCCL_IB_ADDR_FAMILY"] = "AF_INET" if all(p.family == AF_INET for p in firsts) else "AF_INET6"
        if gid_indexes_equal(rails):
            env["NCCL_IB_GID_INDEX"] = env["UCX_IB_GID_INDEX"] = str(rdma[0]["gidIndex"])
        elif firsts:
            family = AF_INET if env["NCCL_IB_ADDR_FAMILY"] == "AF_INET" else AF_INET6
            every = [Prefix.parse(a).ip for r in rails for a in r.get("addresses") or []]
            span = covering_prefix([p for p in every if p.family == family])
            if span is not None:
                env["NCCL_IB_ADDR_RANGE"] = str(span)
    env["RDMA_NETNS_RAILS_FILE"] = rails_file
    return env


def split_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(NCCL's settings, for NCCL_CONF; the rest, for the container environment)."""
    nccl = {k: v for k, v in env.items() if k.startswith("NCCL_")}
    return nccl, {k: v for k, v in env.items() if k not in nccl}


def nccl_conf(nccl: dict[str, str]) -> str:
    """NCCL's file format: NAME=value per line (a line without '=' is skipped by every version)."""
    lines = ["# rdma-netns: this pod's rails; a variable set in the pod spec wins over a line here"]
    return "\n".join(lines + [f"{k}={v}" for k, v in sorted(nccl.items())]) + "\n"


def record(network: str, container_id: str, ifname: str, mode: str, rails: list[dict],
           rails_file: str = RAILS_FILE) -> dict:
    """The per-attachment JSON file's content (contract: version 1)."""
    return {"version": VERSION, "network": network, "containerID": container_id, "ifname": ifname, "mode": mode,
            "rails": rails, "gidIndexesEqual": gid_indexes_equal(rails), "env": environment(rails, rails_file)}
