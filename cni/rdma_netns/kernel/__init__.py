"""Kernel-facing code of both programs: netlink, network namespaces, sysctls, RDMA sysfs and
NETLINK_RDMA. No CNI policy here: modules here import util/ and testhooks.py (a test build's
sysfs root) only, never config/, spec/ or any layer above; policy calls them with plain values.
"""
