"""The node admin's command line (rdma-netns with arguments): a top layer beside commands/, which
may import any layer below the commands (config/, kernel/, kubelet/, rails/, util/, state.py,
mode_policy.py, codecache.py) but runs no CNI command and is never loaded by one.
"""
