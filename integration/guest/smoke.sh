#!/bin/bash
# Guest-side smoke test: proves the guest kernel has a working RDMA subsystem
# with Soft-RoCE, that exclusive netns mode and moving an rxe device into a pod
# namespace work, and what Python the guest can use.
#
# Run it in the guest, never on the host (it changes the system-wide RDMA
# netns mode and makes links and namespaces):
#   integration/guest/run-in-guest.sh --timeout 600 -- integration/guest/smoke.sh
#
# Prints "SMOKE <check>: PASS|FAIL|INFO ..." lines and a final
# "smoke: N passed, N failed"; exits non-zero when a required check failed.
# The Python checks are informational (they never fail the run).
exec 2>&1
set -u

if [ -z "${GUEST_RESULTS:-}" ] && [ "$(hostname)" != virtme-ng ]; then
    echo "smoke.sh: refusing to run outside the guest (use run-in-guest.sh)"
    exit 2
fi

PASS=0 FAIL=0
pass() { PASS=$((PASS + 1)); echo "SMOKE $1: PASS${2:+ $2}"; }
fail() { FAIL=$((FAIL + 1)); echo "SMOKE $1: FAIL${2:+ $2}"; }
info() { echo "SMOKE $1: INFO $2"; }
run() { echo "+ $*"; "$@"; }                 # show, then run
check() {                                    # check NAME cmd... : pass if cmd succeeds
    local name=$1; shift
    if run "$@"; then pass "$name"; else fail "$name" "(exit $?)"; fi
}
has() {  # has NAME "text" cmd... : pass if cmd's output contains text
    local name=$1 want=$2 out; shift 2
    out=$(run "$@" 2>&1); echo "$out"
    if grep -q -- "$want" <<<"$out"; then pass "$name"; else fail "$name" "(no '$want')"; fi
}
lacks() {  # lacks NAME "text" cmd... : pass if cmd succeeds and output lacks text
    local name=$1 bad=$2 out rc; shift 2
    out=$(run "$@" 2>&1); rc=$?; echo "$out"
    if [ $rc = 0 ] && ! grep -q -- "$bad" <<<"$out"; then pass "$name"; else fail "$name" "(has '$bad' or exit $rc)"; fi
}

echo "== kernel $(uname -r), $(nproc) cpu(s)"

# ---------------------------------------------------------------- Soft-RoCE
check modprobe modprobe rdma_rxe
# two RoCE v2 devices joined by a "cable": a veth pair
run ip link add v0 type veth peer name v1
run ip link set v0 up
run ip link set v1 up
# nodad: usable at once; each address gets a RoCE v2 GID entry
run ip -6 addr add fd00::1/64 dev v0 nodad
run ip -6 addr add fd00::2/64 dev v1 nodad
check rxe0-add rdma link add rxe0 type rxe netdev v0
check rxe1-add rdma link add rxe1 type rxe netdev v1
has rdma-dev "rxe1" rdma dev
run rdma link
has system-show "netns shared" rdma system show

# Read only the first entries: rxe has 1024 and a full read takes minutes under
# emulation. Entry order differs from layout to layout: match GIDs by content.
P=/sys/class/infiniband/rxe0/ports/1
gids=""
for i in 0 1 2 3; do
    g=$(cat "$P/gids/$i" 2>/dev/null); t=$(cat "$P/gid_attrs/types/$i" 2>/dev/null)
    n=$(cat "$P/gid_attrs/ndevs/$i" 2>/dev/null)
    echo "rxe0 gid[$i] $g type=${t:--} ndev=${n:--}"
    gids="$gids $g"
done
# fd00::1 as a GID
if grep -q "fd00:0000:0000:0000:0000:0000:0000:0001" <<<"$gids"; then
    pass gid-fd00 "(fd00::1 is a RoCE v2 GID of rxe0)"
else
    fail gid-fd00 "(fd00::1 not among the first 4 GIDs of rxe0)"
fi
run ibv_devices

# ------------------------------------------------------------ exclusive mode
# The pod gets its own netdev: a virtio NIC when the guest has them
# (run-in-guest.sh --net-loop), else the far end of a second veth pair.
# The difference shows when the pod netns is deleted: a physical-like NIC comes
# back to the initial netns (and its rxe device with it), a veth is destroyed
# (and the rxe device on it, and its peer).
PODDEV=""
for n in /sys/class/net/*; do
    [ "$(basename "$(readlink -f "$n/device/driver" 2>/dev/null)")" = virtio_net ] && PODDEV=$(basename "$n")
done
if [ -n "$PODDEV" ]; then
    KIND=virtio
else
    KIND=veth
    run ip link add v2 type veth peer name v3
    run ip link set v2 up
    PODDEV=v3
fi
echo "== pod netdev: $PODDEV ($KIND)"

# Must be set while no other netns exists (EBUSY otherwise).
run ip netns list
check exclusive-set rdma system set netns exclusive
has exclusive-show "netns exclusive" rdma system show
run ip netns add pod1

# Moving the netdev under an rxe device into another netns deletes the rxe
# device. Working order: move the netdev into the pod (and rename it), create
# the rxe device on it from inside the pod (it registers in the initial netns),
# then move the rxe device into the pod.
check rxe2-add-host rdma link add rxe2 type rxe netdev "$PODDEV"
run ip link set "$PODDEV" netns pod1
lacks rxe2-gone-after-netdev-move "rxe2" rdma dev
run ip -n pod1 link set "$PODDEV" name rdma0
run ip -n pod1 link set rdma0 up
run ip -n pod1 -6 addr add fd00::12/64 dev rdma0 nodad
check pod-rxe-add ip netns exec pod1 rdma link add rxe2 type rxe netdev rdma0
has pod-rxe-in-init-netns "rxe2" rdma dev
# best effort: let rxe log why a QP creation is refused (see gsi-qp1 below)
mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug 2>/dev/null
echo 'func rxe_qp_chk_init +p' > /sys/kernel/debug/dynamic_debug/control 2>/dev/null
check rdma-dev-set-netns rdma dev set rxe2 netns pod1
has pod-sees-own "rxe2" ip netns exec pod1 rdma dev
lacks pod-sees-only-own "rxe0" ip netns exec pod1 rdma dev
lacks host-lost-moved "rxe2" rdma dev
has pod-link "rdma0" ip netns exec pod1 rdma link
run ip netns exec pod1 ibv_devices
# rdma_cm needs the GSI QP (QP1) that ib_mad creates for each port; report
# whether it survived the move (its creation is re-done in the pod netns).
run ip netns exec pod1 rdma res show qp
if ip netns exec pod1 rdma res show qp 2>/dev/null | grep -q 'lqpn 1 type GSI'; then
    info gsi-qp1-after-move "rxe2 has its GSI QP1 in pod1"
else
    info gsi-qp1-after-move "rxe2 has NO GSI QP1 in pod1 (ib_mad could not re-create it; rdma_cm needs it): $(dmesg | grep -e 'rxe2' | grep -i -e gsi -e qp1 -e 'open port' | tail -n 3 | tr '\n' ';')"
fi
run ip netns exec pod1 ls /sys/class/infiniband /dev/infiniband
run cat /sys/class/infiniband/rxe2/ports/1/gids/1 2>/dev/null   # invisible from the host
run ip netns exec pod1 cat /sys/class/infiniband/rxe2/ports/1/gids/1

# SYS_SET with another netns present must fail (EBUSY) and leave the mode
if run rdma system set netns shared; then
    fail sys-set-busy "(mode switch succeeded while pod1 exists)"
else
    pass sys-set-busy "(refused while pod1 exists)"
fi
has mode-unchanged "netns exclusive" rdma system show

# Deleting the pod netns: the kernel moves RDMA devices back to the initial
# netns, and physical netdevs too; virtual ones (veth) are destroyed. An rxe
# device is deleted whenever its netdev leaves its netns, so what happens to it
# here is reported, not required. Cleanup is asynchronous: poll.
run ip netns del pod1
for _ in $(seq 1 20); do
    ip -br link | grep -q "^rdma0 " && rdma dev | grep -q rxe2 && break
    [ $KIND = veth ] && ! ip link show v2 >/dev/null 2>&1 && break
    sleep 0.5
done
run ip -br link
run rdma dev
run sh -c 'dmesg | grep -i -e rxe -e infiniband | tail -n 5'
if [ $KIND = virtio ]; then
    has netdev-back-after-netns-del "rdma0" ip -br link
else
    lacks veth-destroyed-with-netns "v2" ip -br link
fi
if rdma dev | grep -q rxe2; then
    info rxe2-after-netns-del "rxe2 is back in the initial netns"
else
    info rxe2-after-netns-del "rxe2 is gone (deleted with its $KIND netdev)"
fi
has rxe0-rxe1-untouched "rxe1" rdma dev
check shared-again rdma system set netns shared
run rdma system show

# ------------------------------------------------------------ Python (info)
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
t0=$EPOCHREALTIME
if out=$(/usr/bin/python3 -c '
import pyverbs.device as d
print("devices", [x.name.decode() for x in d.get_device_list()])' 2>&1); then
    info pyverbs "/usr/bin/python3 import OK in $(since "$t0")s: $out"
else
    info pyverbs "/usr/bin/python3 import FAILED: $out"
fi
# a virtual environment built on the host (has pyroute2); slow to import under TCG
VPY=${SMOKE_VENV_PYTHON:-/tmp/v/bin/python}
if [ -x "$VPY" ]; then
    t0=$EPOCHREALTIME
    if out=$("$VPY" -c 'import sys, pyroute2; print(sys.version.split()[0], "pyroute2", pyroute2.__version__)' 2>&1); then
        info venv-pyroute2 "$VPY: import pyroute2 took $(since "$t0")s: $out"
    else
        info venv-pyroute2 "$VPY FAILED after $(since "$t0")s: $out"
    fi
else
    info venv-pyroute2 "no $VPY"
fi

echo "smoke: $PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
