"""rdma-netns-dp: the Kubernetes device plugin that advertises RDMA (`rdma/hca`) to kubelet.

Hand-written modules live here; the protobuf/gRPC code generated from kubelet's API is kept
apart in `api/` (regenerate with dp/gen-proto.sh, never edit).
"""

__version__ = "0.2.0"
