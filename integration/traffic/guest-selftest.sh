#!/usr/bin/env bash
# Guest-side self-test of the traffic tools: builds BY HAND (ip/rdma only, no
# rdma-netns plugin) the pod layouts that carried real RDMA traffic on kernel
# 7.3.4 (see /work/shared/real-rdma-kernel.md) and runs rc_exchange.py (verbs,
# RC WRITE + SEND, verified byte for byte) and rdma_cm_check.sh (rping) between
# two pod namespaces:
#
#   shared-macvlan  macvlan (bridge) of a common lower veth in each pod,
#                   Soft-RoCE created on the pod's own macvlan from inside the pod
#                   (rxe on the lower device drops RoCE arriving on an upper one).
#                   The lower gets an rxe device too (rxl0), like a node's NIC:
#                   its GID table also lists the pods' addresses, so rc_exchange
#                   must choose the pod's device. It is deleted before rping, as
#                   rdma_cm would bind to it (first device holding the GID).
#   shared-ipvlan   the same with ipvlan l2, each pod's ipvlan on one end of the
#                   lower veth pair (two "nodes"): see the next layout for why
#   shared-ipvlan-common-lower
#                   ipvlan l2 of ONE lower in both pods: recorded, not required.
#                   The ipvlans share the lower's MAC and rxe loops back any packet
#                   whose destination MAC is its own netdev's (rxe_prepare sets
#                   RXE_LOOPBACK_MASK), so RoCE never leaves the sending pod.
#                   Hardware RoCE has no such shortcut; it is a Soft-RoCE limit.
#   exclusive       `rdma system set netns exclusive` first; each pod gets its own
#                   netdev (the virtio NICs of run-in-guest.sh --net-loop, else the
#                   two ends of a veth pair), the rxe device is created on it from
#                   inside the pod and then moved there with `rdma dev set`.
#                   Only verbs traffic is required here: rping is run to record the
#                   known rdma_cm failure and its kernel evidence (dmesg), not checked.
#
# Run it in the guest only (it changes the system-wide RDMA netns mode):
#   integration/guest/run-in-guest.sh --timeout 1200 [--net-loop] -- \
#       bash integration/traffic/guest-selftest.sh
#
# Prints "SELFTEST <check>: PASS|FAIL|INFO|KNOWN-ISSUE ..." lines and a final
# "selftest: N passed, N failed"; exits 1 when a check failed (or none passed).
# The tools' JSON lines and the check list are copied to $GUEST_RESULTS.
# Env: SELFTEST_STEP_TIMEOUT (seconds per tool run, default 240).
exec 2>&1
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RC_EXCHANGE=$HERE/rc_exchange.py
RDMA_CM_CHECK=$HERE/rdma_cm_check.sh
PYTHON=/usr/bin/python3   # Debian's python3-pyverbs is built for it only
STEP_TIMEOUT=${SELFTEST_STEP_TIMEOUT:-240}
ADDR1=fd00::11
ADDR2=fd00::12
OUR_RDMA_DEVS="rxl0 rxm1 rxm2 rxi1 rxi2 rxc1 rxc2 rxp1 rxp2"
WORK=""

record() { echo "SELFTEST $1: $2${3:+ $3}" | tee -a "$WORK/results"; }
pass() { record "$1" PASS "${2:-}"; }
fail() { record "$1" FAIL "${2:-}"; }
info() { echo "SELFTEST $1: INFO $2"; }
known() { echo "SELFTEST $1: KNOWN-ISSUE $2"; }
run() { echo "+ $*"; "$@"; }

# check NAME cmd...: PASS when cmd succeeds
check() {
    local name=$1 rc=0; shift
    run "$@" || rc=$?
    if [ "$rc" = 0 ]; then pass "$name"; else fail "$name" "(exit $rc)"; fi
}

# output_check NAME WANT BAD cmd...: PASS when cmd succeeds, prints WANT and not BAD
output_check() {
    local name=$1 want=$2 bad=$3 out rc=0; shift 3
    out=$(run "$@" 2>&1) || rc=$?
    echo "$out"
    if [ "$rc" = 0 ] && grep -q -- "$want" <<<"$out" && ! grep -q -- "$bad" <<<"$out"; then
        pass "$name"
    else
        fail "$name" "(exit $rc; want '$want', not '$bad')"
    fi
}

# keep KIND FILE: copy a tool's output to the results folder for the host
keep() { [ -z "${GUEST_RESULTS:-}" ] || cat "$2" >>"$GUEST_RESULTS/traffic-$1.jsonl"; }

# in_guest: this script rewires the whole RDMA subsystem; never on a real host
in_guest() { [ -n "${GUEST_RESULTS:-}" ] || [ "$(hostname)" = virtme-ng ]; }

# pod_netdev POD NETDEV DEV: give NETDEV (already in POD) the pod's name and
# address, and create the Soft-RoCE device DEV on it from inside the pod
pod_netdev() {
    local pod=$1 netdev=$2 dev=$3 addr
    addr=$([ "$pod" = pod1 ] && echo "$ADDR1" || echo "$ADDR2")
    run ip -n "$pod" link set "$netdev" name rdma0   # the plugin's CNI_IFNAME
    run ip -n "$pod" link set lo up
    run ip -n "$pod" link set rdma0 up
    # nodad: usable at once (the GID entry exists even while tentative)
    run ip -n "$pod" -6 addr add "$addr/64" dev rdma0 nodad
    run ip netns exec "$pod" rdma link add "$dev" type rxe netdev rdma0
}

# show_gids POD DEV: the first GID entries as the pod sees them (by content,
# the index of the pod address differs from layout to layout)
show_gids() {
    # shellcheck disable=SC2016  # expanded by the inner bash
    ip netns exec "$1" bash -c 'p=/sys/class/infiniband/$1/ports/1
        for i in 0 1 2 3; do
            echo "$1 gid[$i] $(cat $p/gids/$i) $(cat $p/gid_attrs/types/$i 2>/dev/null || echo -)" \
                 "ndev=$(cat $p/gid_attrs/ndevs/$i 2>/dev/null || echo -)"
        done' _ "$2"
}

# json_field NAME FILE: a number from a tool's one-line JSON report
json_field() { grep -oE "\"$1\": [0-9.]+" "$2" | grep -oE '[0-9.]+$'; }

# rc_run OUT TIMEOUT: rc_exchange.py server in pod1, client in pod2, their
# JSON lines in OUT.server/OUT.client; succeeds when both sides exit 0 (the
# client only does when the server verified every byte)
rc_run() {
    local out=$1 timeout=$2 server_rc=0 client_rc=0 pid
    ip netns exec pod1 timeout -k 5 $((timeout + 30)) "$PYTHON" "$RC_EXCHANGE" server \
        --addr "$ADDR1" --timeout "$timeout" >"$out.server" 2>"$out.server.err" &
    pid=$!
    ip netns exec pod2 timeout -k 5 $((timeout + 30)) "$PYTHON" "$RC_EXCHANGE" client \
        --addr "$ADDR2" --peer "$ADDR1" --timeout "$timeout" \
        >"$out.client" 2>"$out.client.err" || client_rc=$?
    wait "$pid" || server_rc=$?
    cat "$out.server" "$out.server.err" "$out.client" "$out.client.err"
    keep rc_exchange "$out.server"; keep rc_exchange "$out.client"
    echo "rc_exchange: server exit $server_rc, client exit $client_rc"
    [ "$server_rc" = 0 ] && [ "$client_rc" = 0 ]
}

# rc_pair NAME: rc_run as a required check
rc_pair() {
    local out=$WORK/${1//\//-}
    if rc_run "$out" "$STEP_TIMEOUT"; then
        pass "$1" "($(json_field bytes "$out.server") bytes verified, transfer $(json_field transfer_s "$out.server") s, gid index $(json_field gid_index "$out.server"))"
    else
        fail "$1"
    fi
}

# rdma_cm_pair TIMEOUT: rdma_cm_check.sh from pod2 to pod1
rdma_cm_pair() {
    local rc=0
    "$RDMA_CM_CHECK" --server-netns pod1 --server-addr "$ADDR1" --client-netns pod2 \
        --client-addr "$ADDR2" --count 10 --timeout "$1" >"$WORK/rdma_cm.json" || rc=$?
    cat "$WORK/rdma_cm.json"
    keep rdma_cm "$WORK/rdma_cm.json"
    return "$rc"
}

# traffic NAME: what every layout must carry: IPv6, verbs RC
traffic() {
    check "$1/ping" ip netns exec pod2 busybox ping -c 3 -w 30 "$ADDR1"
    rc_pair "$1/rc-exchange"
}

# shared_pods KIND LOWER1 LOWER2 TAG: podN gets a KIND sub-interface of
# LOWERN (ends of the veth pair lower0/lower1) and Soft-RoCE device rx<TAG>N on
# it. lower0 carries an RDMA device too, as a node's NIC would: its GID table
# lists the pods' addresses as well, so rc_exchange must pick the right device.
shared_pods() {
    local kind=$1 tag=$4 mode i lowers=("$2" "$3")
    mode=$([ "$kind" = macvlan ] && echo bridge || echo l2)
    run ip link add lower0 type veth peer name lower1
    run ip link set lower0 up
    run ip link set lower1 up
    run rdma link add rxl0 type rxe netdev lower0
    for i in 1 2; do
        run ip netns add "pod$i"
        run ip link add "sub$i" link "${lowers[i - 1]}" type "$kind" mode "$mode"
        run ip link set "sub$i" netns "pod$i"
        pod_netdev "pod$i" "sub$i" "rx$tag$i"
    done
    show_gids pod1 "rx${tag}1"
    show_gids pod1 rxl0
    run ip netns exec pod1 rdma res show qp || true   # a GSI QP (QP1) per device
}

# shared_layout NAME KIND LOWER2 TAG: required traffic, rping included
shared_layout() {
    shared_pods "$2" lower0 "$3" "$4"
    traffic "$1"
    # rdma_cm binds to the first device whose GID table holds the address:
    # that is rxl0, which never receives RoCE sent to an upper device, and the
    # peer's CM rejects the connection (REJECTED, error 8: no listener there)
    run rdma link delete rxl0
    if rdma_cm_pair "$STEP_TIMEOUT"; then pass "$1/rdma-cm"; else fail "$1/rdma-cm"; fi
}

# rxe_counter DEV NAME: one Soft-RoCE hardware counter (0 when not shown)
rxe_counter() {
    rdma statistic show link "$1/1" | grep -oE "(^| )$2 [0-9]+" | grep -oE '[0-9]+$' || echo 0
}

# ipvlan_common_lower: see the header; shows where the packets went
ipvlan_common_lower() {
    local name=shared-ipvlan-common-lower
    shared_pods ipvlan lower0 lower0 c
    if rc_run "$WORK/$name" 30; then
        info "$name" "RC traffic passed between ipvlans of one lower on this kernel"
    else
        known "$name" "no RC traffic: client rxc2 sent $(rxe_counter rxc2 sent_pkts) packets, server rxc1 received $(rxe_counter rxc1 rcvd_pkts) (rxe loops back frames to its own MAC)"
    fi
}

# set_mode MODE: the switch is refused (EBUSY) while any other netns exists,
# and deleted ones linger until the kernel's cleanup work ran: retry a while
set_mode() {
    local _
    for _ in $(seq 1 60); do
        rdma system set netns "$1" 2>/dev/null && return 0
        sleep 1
    done
    run rdma system set netns "$1"
}

# pod_nics: two netdevs to hand to the pods: virtio NICs (--net-loop) behave
# like physical ones; else a veth pair
pod_nics() {
    local n nics=()
    for n in /sys/class/net/*; do
        [ "$(basename "$(readlink -f "$n/device/driver" 2>/dev/null)")" = virtio_net ] &&
            nics+=("$(basename "$n")")
    done
    if [ "${#nics[@]}" -ge 2 ]; then
        echo "${nics[0]} ${nics[1]}"
    else
        ip link add x1 type veth peer name x2 >&2
        echo "x1 x2"
    fi
}

# enable_rxe_debug: rxe says why it refuses a QP only through dynamic debug
enable_rxe_debug() {
    mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug || true
    echo 'func rxe_qp_chk_init +p' >/sys/kernel/debug/dynamic_debug/control ||
        info exclusive/rxe-debug "dynamic debug unavailable: rxe's reason will be missing"
}

# gsi_evidence SINCE: kernel lines about the GSI QP (QP1) after dmesg line SINCE
gsi_evidence() {
    dmesg | tail -n +"$1" | grep -E "GSI QP|QP1|open port|rxp[12]" || true
}

# exclusive_rdma_cm GSI_LOG QPS: run rping and, when it fails, say why with the
# kernel's own words (dmesg at the moves) and pod1's QP list (no GSI QP)
exclusive_rdma_cm() {
    if rdma_cm_pair 30; then   # a failed rping client hangs until killed
        info exclusive/rdma-cm "rping worked in exclusive mode on this kernel"
        return 0
    fi
    known exclusive/rdma-cm "rping fails in exclusive mode (rdma_cm_check output above)"
    if grep -q "type GSI" <<<"$2"; then
        info exclusive/gsi-qp1 "rxp1 has a GSI QP (QP1) in pod1"
    else
        known exclusive/gsi-qp1 "rxp1 has no GSI QP (QP1) in pod1 after the move: no CM MADs, no rdma_cm"
    fi
    if [ -n "$1" ]; then
        known exclusive/gsi-dmesg "kernel log at 'rdma dev set ... netns':"
        # shellcheck disable=SC2001  # prefix every line
        sed 's/^/    dmesg: /' <<<"$1"
    else
        info exclusive/gsi-dmesg "no GSI/QP1 lines in dmesg"
    fi
}

exclusive_layout() {
    local nics i mark gsi_log qps
    run ip netns list
    set_mode exclusive
    output_check exclusive/mode-set "netns exclusive" "netns shared" rdma system show
    read -ra nics <<<"$(pod_nics)"
    info exclusive/netdevs "${nics[*]}"
    enable_rxe_debug
    mark=$(( $(dmesg | wc -l) + 1 ))
    for i in 1 2; do
        run ip netns add "pod$i"
        # the netdev moves first: moving it under an existing rxe deletes the rxe
        run ip link set "${nics[i - 1]}" netns "pod$i"
        pod_netdev "pod$i" "${nics[i - 1]}" "rxp$i"
        run rdma dev set "rxp$i" netns "pod$i"
    done
    gsi_log=$(gsi_evidence "$mark")
    output_check exclusive/pod1-sees-own "rxp1" "rxp2" ip netns exec pod1 rdma dev
    output_check exclusive/pod2-sees-own "rxp2" "rxp1" ip netns exec pod2 rdma dev
    output_check exclusive/host-sees-neither "" "rxp" rdma dev
    show_gids pod1 rxp1
    qps=$(run ip netns exec pod1 rdma res show qp 2>&1 || true)
    echo "$qps"
    traffic exclusive
    exclusive_rdma_cm "$gsi_log" "$qps"
}

# teardown: remove what a layout made, whether it finished or not
teardown() {
    local ns dev _
    for ns in $(ip netns list | awk '{ print $1 }'); do ip netns del "$ns"; done
    for dev in lower0 x1; do ip link del "$dev" 2>/dev/null || true; done
    # rxe devices go with their netdevs, asynchronously; names are reused per layout
    for _ in $(seq 1 30); do
        rdma dev | grep -qwE "${OUR_RDMA_DEVS// /|}" || return 0
        sleep 1
    done
    for dev in $OUR_RDMA_DEVS; do rdma link delete "$dev" 2>/dev/null || true; done
}

# run_layout NAME FUNC ARGS...: a layout stops at its first failing setup
# command (a subshell with errexit), which counts as a FAIL of NAME/setup
run_layout() {
    local name=$1 rc t0=$SECONDS; shift
    echo "=================== $name"
    set +e
    (set -e; "$@")
    rc=$?
    set -e
    [ "$rc" = 0 ] || fail "$name/setup" "(stopped with exit $rc after the last '+' command above)"
    info "$name/wall-time" "$((SECONDS - t0)) s"
    teardown
}

main() {
    if ! in_guest; then
        echo "guest-selftest.sh: refusing to run outside the guest (use run-in-guest.sh)"
        exit 2
    fi
    WORK=$(mktemp -d)
    : >"$WORK/results"
    echo "== kernel $(uname -r), $(nproc) cpu(s)"
    run modprobe rdma_rxe
    run_layout shared-macvlan shared_layout shared-macvlan macvlan lower0 m
    run_layout shared-ipvlan shared_layout shared-ipvlan ipvlan lower1 i
    run_layout shared-ipvlan-common-lower ipvlan_common_lower
    run_layout exclusive exclusive_layout
    set_mode shared || info restore "could not switch back to shared mode"
    [ -z "${GUEST_RESULTS:-}" ] || cp "$WORK/results" "$GUEST_RESULTS/selftest-results.txt"
    local passed failed
    passed=$(grep -c ': PASS' "$WORK/results" || true)
    failed=$(grep -c ': FAIL' "$WORK/results" || true)
    echo "selftest: $passed passed, $failed failed"
    [ "$failed" = 0 ] && [ "$passed" -gt 0 ]
}

main "$@"
