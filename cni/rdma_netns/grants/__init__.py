"""What the pod was granted: the source of grants that ADD's pairing gate (commands/pairing.py)
asks: kubelet's device-plugin units through the rdma-netns-dp broker, or kubelet's PodResources
API itself when the broker is away (kubelet/podresources.py, grpc loaded only then); on a DRA node
the broker answers from the claims the daemon's DRA driver prepared, with the rails they hold.
early.py sends the question as soon as the raw config is read (standard library and util/jsonio.py
only: it is the first thing an ADD loads); client.py takes its answer or asks again, and answers
with a Grant (found, the unit IDs, how it learnt them, and from DRA the rails to attach). Modules here may import util/,
spec/, config/defaults.py and config/netconf.py, kubelet/ and events.py; never commands/,
modes/, rails/ or publish/: they say what was granted, not what to do with it.
"""
