"""The node admin's command line (rdma-netns with arguments)."""
