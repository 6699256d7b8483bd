"""Clients of kubelet's own APIs, below both the CNI and the device plugin (rdma_netns_dp imports
them; nothing here imports rdma_netns_dp). kubelet/api/ holds generated code only (made by
dp/gen-proto.sh from its .proto files); the hand-written clients sit beside it. Importing this
package starts nothing and loads no grpc: a client imports grpc when it first asks kubelet.
Modules here import config/defaults.py (the sockets' defaults) and each other only.
"""
