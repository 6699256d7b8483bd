"""rdma-netns: RDMA networking for Kubernetes pods without hostNetwork.

Kept import-free: the CNI entry point must start fast (see entry.py).
"""

__version__ = "0.2.0"
