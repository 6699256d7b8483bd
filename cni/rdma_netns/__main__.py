"""`python -m rdma_netns` behaves exactly like the `rdma-netns` executable."""

from rdma_netns.entry import main

raise SystemExit(main())
