"""rdma-netns: RDMA networking for Kubernetes pods without hostNetwork.

Kept import-free: the CNI entry point must start fast (see entry.py). Each folder is a layer,
and its __init__.py says what it holds and what it may import: commands/ and admin/ (what a call
or an admin does), modes/ (how an interface gets into a pod), grants/ (what the pod was granted),
rails/ (what is done per rail), publish/ (what a pod is handed), config/, kubelet/, kernel/ (the
kernel, no policy), spec/ (the CNI protocol) and util/ (standard-library helpers). Those faces
import nothing either, but for commands/ (its log()) and modes/ (the mode selection). The
modules left here are the entry points (entry.py, __main__.py) and the few that every layer
shares or that must keep their place:
- state.py: the attachment record the commands write and the admin tool, rails/gid_audit.py
  and the device plugin read;
- events.py: the call's metrics event, noted by whichever layer learns something (grants/, the
  pairing gate) and sent by entry.py;
- mode_policy.py: the one kernel-mode rule of the CNI, the device plugin and the admin tool
  (inside modes/ it would load the modes' selection code, which modes/__init__.py holds, with it);
- codecache.py: a node's launcher imports it by this name, before anything else;
- testhooks.py, faults.py: the test-only hooks, whose marker file sits in this folder.
"""

__version__ = "0.2.0"
