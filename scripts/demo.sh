#!/usr/bin/env bash
# The rdma-netns demo: two pods on two rails, wired by the plugin exactly as a container runtime
# would run it (CNI_* environment + config on stdin, host-local IPAM found through CNI_PATH).
#
# On this machine (no RDMA hardware) the two "RDMA NICs" are veth pairs and the config sets
# "requireRdma": false; on an RDMA node the same config without that line also checks that
# each pod address became a RoCE v2 GID of the NIC. Everything the demo creates is removed at
# the end, and the last step shows that the plugin's DEL left nothing behind.
#
# `demo.sh --rdma` runs the same two-pod set-up on a real RDMA subsystem instead: a Debian 7.x
# kernel booted under QEMU (integration/guest/), Soft-RoCE devices, and RDMA traffic between the
# pods (an RC queue pair moving a checked buffer, and rping over rdma_cm).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
if [ "${1:-}" = "--rdma" ]; then
  integration/guest/fetch-kernel.sh >/dev/null
  exec integration/guest/run-in-guest.sh --timeout 1800 -- bash integration/guest/demo-rdma.sh
fi

PLUGIN=$PWD/.venv/bin/rdma-netns
CNI_PATH=/usr/lib/cni
PODS=(rdemo-pod-a rdemo-pod-b)
RAILS=(rdemo0 rdemo1)

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

remove_demo_links() {
  for pod in "${PODS[@]}"; do ip netns del "$pod" 2>/dev/null || true; done
  for rail in "${RAILS[@]}"; do ip link del "$rail" 2>/dev/null || true; done
}
remove_demo_links  # leftovers of an interrupted earlier run
WORK=$(mktemp -d /tmp/rdma-netns-demo.XXXXXX)
STATE=$WORK/state
IPAM_DATA=$WORK/ipam
trap 'remove_demo_links; rm -rf "$WORK"' EXIT

say "The node: two veth-backed 'RDMA NICs' and two pod network namespaces"
for rail in "${RAILS[@]}"; do
  ip link add "$rail" type veth peer name "${rail}-fabric"   # the peer end stands for the switch port
  ip link set "$rail" up
  ip link set "${rail}-fabric" up
done
for pod in "${PODS[@]}"; do ip netns add "$pod"; ip -n "$pod" link set lo up; done
ip -br link show | grep rdemo
echo "kernel RDMA mode: $("$PLUGIN" mode 2>&1 || true)"

CONF=$WORK/rdma.json
cat > "$CONF" <<JSON
{
  "cniVersion": "1.1.0",
  "name": "rdma-demo",
  "type": "rdma-netns",
  "mode": "shared",
  "link": "macvlan",
  "pairing": false,
  "requireRdma": false,
  "stateDir": "$STATE",
  "rails": [
    {"netdev": "rdemo0",
     "ipam": {"type": "host-local", "dataDir": "$IPAM_DATA", "ranges": [[{"subnet": "fd00:a0::/64"}]]}},
    {"netdev": "rdemo1", "ifname": "rdma1",
     "ipam": {"type": "host-local", "dataDir": "$IPAM_DATA", "ranges": [[{"subnet": "fd00:a1::/64"}]]}}
  ]
}
JSON
say "The network config the runtime sends on stdin"
cat "$CONF"

# cni COMMAND POD: run the plugin the way a runtime does, print what it answered and how long it took.
cni() {
  local command=$1 pod=$2 out rc start end
  start=$(date +%s%N)
  set +e
  out=$(CNI_COMMAND=$command CNI_CONTAINERID="demo-$pod" CNI_NETNS="/var/run/netns/$pod" CNI_IFNAME=eth0 \
        CNI_PATH=$CNI_PATH "$PLUGIN" < "$CONF")
  rc=$?
  set -e
  end=$(date +%s%N)
  printf '%s %s -> exit %d in %d ms\n' "$command" "$pod" "$rc" $(((end - start) / 1000000))
  [ -n "$out" ] && printf '%s\n' "$out" | .venv/bin/python -m json.tool
  return $rc
}

say "STATUS: can the plugin take ADDs now?"
CNI_COMMAND=STATUS CNI_PATH=$CNI_PATH "$PLUGIN" < "$CONF" && echo "STATUS -> ready"

say "ADD: env CNI_COMMAND=ADD CNI_CONTAINERID=demo-<pod> CNI_NETNS=/var/run/netns/<pod> CNI_IFNAME=eth0 CNI_PATH=$CNI_PATH rdma-netns < rdma.json"
echo "(as the pod's only network, rail 0 is named CNI_IFNAME, eth0: a CRI runtime takes the pod IP from it)"
for pod in "${PODS[@]}"; do cni ADD "$pod"; done

say "What pod a got (one macvlan per rail, IPv6 usable at once, a routing table + rule per rail)"
ip -n rdemo-pod-a -br addr show
ip -n rdemo-pod-a -6 rule show | grep -v "lookup local\|lookup main"

addr() { ip -n "$1" -6 -j addr show dev "$2" scope global | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["addr_info"][0]["local"])'; }
say "Ping between the pods over IPv6 on each rail (right after ADD: no DAD wait)"
for ifname in eth0 rdma1; do
  src=$(addr rdemo-pod-a "$ifname"); dst=$(addr rdemo-pod-b "$ifname")
  echo "-- $ifname: $src -> $dst"
  ip netns exec rdemo-pod-a ping -6 -c 2 -i 0.2 -W 2 -I "$src" "$dst" | tail -2
done

say "CHECK"
for pod in "${PODS[@]}"; do cni CHECK "$pod"; done

say "DEL"
for pod in "${PODS[@]}"; do cni DEL "$pod"; done

say "Nothing left behind"
leftover=0
for pod in "${PODS[@]}"; do
  links=$(ip -n "$pod" -br link | awk '{print $1}' | grep -v '^lo$' || true)
  rules=$(ip -n "$pod" -6 rule | grep -v "lookup local\|lookup main" || true)
  echo "$pod: interfaces besides lo: ${links:-none}; extra rules: ${rules:-none}"
  [ -z "$links$rules" ] || leftover=1
done
leases=$(find "$IPAM_DATA" -type f ! -name lock ! -name 'last_reserved_ip*' | wc -l)
states=$(find "$STATE/rdma-demo" -maxdepth 1 -type f | wc -l)
markers=$(find "$STATE/rdma-demo/released" -type f -name '*:*' 2>/dev/null | wc -l)
echo "IPAM leases held: $leases; plugin state files: $states (released markers, which make repeated DELs cheap and expire in an hour: $markers)"
[ "$leases" -eq 0 ] && [ "$states" -eq 0 ] || leftover=1
if [ "$leftover" -ne 0 ]; then echo "demo: something was left behind" >&2; exit 1; fi
say "Demo finished: ADD, ping on both rails, CHECK, DEL, clean."
