"""The network config's defaults, in one place: the pydantic model (model.py), the hot-path loader
(loader.py) and NetConfig (netconf.py) all take them from here, so they cannot drift apart.

Constants only, and no imports: the CNI hot path loads this module on every call, and it must
import neither the model (pydantic) nor the loader (the two used to import each other).
"""

# Keys a runtime adds per invocation: they are not part of the network's identity. Multus adds
# "deviceID" (and, since 4.0, "pciBusID") to every plugin of a NetworkAttachmentDefinition
# annotated k8s.v1.cni.cncf.io/resourceName: the device it took from the pod's grant. rdma-netns
# asks kubelet for the whole grant itself (resourceName), so it accepts and ignores them.
RUNTIME_KEYS = ("args", "runtimeConfig", "prevResult", "cni.dev/valid-attachments", "cni.dev/attachments",
                "deviceID", "pciBusID")
DEFAULT_STATE_DIR = "/var/lib/cni/rdma-netns"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_POD_GRANTS_SOCKET = "/run/rdma-netns/pod-grants.sock"
# 2 s: a node starting a Job's pods while another client drains kubelet's PodResources bucket answers
# late, not never; 500 ms failed 1 of 32 such pods (107) on a loaded 2-core CI machine (issue 37).
DEFAULT_POD_RESOURCES_TIMEOUT_MS = 2000
MAX_POD_RESOURCES_TIMEOUT_MS = 10000
DEFAULT_POD_INFO_DIR = "/run/rdma-netns/pods"
DEFAULT_CDI_SPEC_DIR = "/var/run/cdi"
DEFAULT_CDI_KIND = "rdma-netns.io/pod"
# The device-plugin daemon's FIFO for each call's metrics event (events.py, its DEFAULT_PATH).
DEFAULT_EVENTS_FIFO = "/run/rdma-netns/cni-events"

# What teardown needs when the config cannot be validated and an old state did not record it:
# the model's defaults (loader.teardown_network and NetConfig fall back to the same values).
TEARDOWN_DEFAULTS = {"routeTableBase": 100, "rulePriorityBase": 1000, "ipamTimeoutSeconds": 30.0,
                     "lockTimeoutSeconds": 10.0, "link": "macvlan", "linkMode": None}
# How long ADD waits for a rail address's GID. Soft-RoCE adds it within milliseconds; mlx5 writes
# each entry with a firmware command, queued on the RDMA core's one ordered work queue for the
# whole node (roce_gid_mgmt.c, "gid-cache-wq"), so a burst of pods on 8 rails waits behind every
# other rail's entries. The wait ends as soon as the GID is there: a long bound costs only an ADD
# that fails anyway, and that one now says why (table full, or what the port has instead).
DEFAULT_GID_WAIT_MS = 3000
