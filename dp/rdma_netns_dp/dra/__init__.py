"""The DRA driver: the device plugin's Dynamic Resource Allocation mode, which publishes the
node's RDMA devices as `resource.k8s.io/v1` ResourceSlices and prepares the ResourceClaims that
the scheduler allocated from them."""
