"""Kernel-facing code: netlink, network namespaces, sysctls, RDMA sysfs. No CNI policy here."""
