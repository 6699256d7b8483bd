#!/usr/bin/env bash
# Guest side of `scripts/demo.sh --rdma`: the two-pod RDMA exchange on a real RDMA subsystem.
# rdma-netns wires two pods in shared mode onto a Soft-RoCE "NIC" (rxe on a veth), the kernel
# turns each pod address into a RoCE v2 GID, and an RC queue pair moves a checked buffer from
# one pod to the other, then rping (rdma_cm) runs between their IPv6 addresses.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { printf '\n== %s\n' "$*"; }

modprobe rdma_rxe
mkdir -p /var/run/netns
WORK=$(mktemp -d)
LAUNCHER=$WORK/rdma-netns
.venv/bin/rdma-netns install-launcher "$LAUNCHER" >/dev/null

say "The node: an RDMA NIC (Soft-RoCE rxe0 on veth v0) and two pods"
ip link add v0 type veth peer name v0-fabric
ip link set v0 up; ip link set v0-fabric up
rdma link add rxe0 type rxe netdev v0
rdma dev
"$LAUNCHER" mode | head -1
for pod in pod-a pod-b; do ip netns add $pod; ip -n $pod link set lo up; done

cat > "$WORK/rdma.json" <<JSON
{"cniVersion": "1.1.0", "name": "rdma-demo", "type": "rdma-netns", "mode": "shared", "pairing": false,
 "stateDir": "$WORK/state", "gidWaitMs": 5000,
 "rails": [{"netdev": "v0", "ifname": "rdma0",
            "ipam": {"type": "host-local", "dataDir": "$WORK/ipam", "ranges": [[{"subnet": "fd00:a0::/64"}]]}}]}
JSON

cni() {
  CNI_COMMAND=$1 CNI_CONTAINERID=$2 CNI_NETNS=/var/run/netns/$2 CNI_IFNAME=rdma0 CNI_PATH=/usr/lib/cni \
    "$LAUNCHER" < "$WORK/rdma.json"
}
say "ADD (requireRdma is on: the rail must be an RDMA netdev, and each address must become a GID)"
declare -A ADDR
for pod in pod-a pod-b; do
  start=$(date +%s%N); out=$(cni ADD $pod); end=$(date +%s%N)
  echo "$pod: $out"
  echo "   ($(((end - start) / 1000000)) ms in this emulated guest)"
  ADDR[$pod]=$(printf '%s' "$out" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["ips"][0]["address"].split("/")[0])')
done

say "rxe0's GID table now holds the pods' addresses, with the pods' interfaces as ndev"
for i in 0 1 2 3 4 5; do
  printf '%s  %-8s %s\n' "$(cat /sys/class/infiniband/rxe0/ports/1/gids/$i)" \
    "$(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/$i 2>/dev/null || echo -)" \
    "$(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$i 2>/dev/null || echo -)"
done

say "CHECK"
for pod in pod-a pod-b; do cni CHECK $pod && echo "$pod: CHECK ok"; done

say "RDMA traffic between the pods"
# Real NICs carry the pods' traffic on the GIDs just shown. Soft-RoCE cannot receive what arrives
# on an upper device of its netdev, so the traffic runs over an rxe on each pod's own interface,
# and rxe0 goes first so that rdma_cm cannot pick it for the pods' addresses.
rdma link delete rxe0
ip netns exec pod-a rdma link add rxa type rxe netdev rdma0
ip netns exec pod-b rdma link add rxb type rxe netdev rdma0
ip netns exec pod-a /usr/bin/python3 integration/traffic/rc_exchange.py server --addr "${ADDR[pod-a]}" \
   --device rxa --timeout 240 > "$WORK/server.json" &
server=$!
ip netns exec pod-b /usr/bin/python3 integration/traffic/rc_exchange.py client --addr "${ADDR[pod-b]}" \
   --peer "${ADDR[pod-a]}" --device rxb --timeout 240
wait $server
echo "server: $(cat "$WORK/server.json")"
bash integration/traffic/rdma_cm_check.sh --server-netns pod-a --server-addr "${ADDR[pod-a]}" \
   --client-netns pod-b --client-addr "${ADDR[pod-b]}" --count 5 --timeout 240

say "DEL"
for pod in pod-a pod-b; do
  ip netns exec $pod rdma link delete "rx${pod#pod-}"
  cni DEL $pod && echo "$pod: DEL ok"
done
left=$(find "$WORK/state/rdma-demo" -type f | wc -l)
links=$(for pod in pod-a pod-b; do ip -n $pod -br link | grep -vc '^lo ' || true; done | awk "{s+=\$1} END {print s+0}")
echo "state files left: $left; pod interfaces left besides lo: $links"
[ "$left" -eq 0 ] && [ "$links" -eq 0 ]
say "RDMA demo finished"
