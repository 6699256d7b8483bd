from rdma_netns_dp.main import main

raise SystemExit(main())
