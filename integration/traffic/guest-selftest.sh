#!/usr/bin/env bash
# Guest-side self-test of the traffic tools: builds BY HAND (ip/rdma only, no
# rdma-netns plugin) the pod layouts that carried real RDMA traffic on kernel
# 7.3.4 (see /work/shared/real-rdma-kernel.md) and runs rc_exchange.py (verbs,
# RC WRITE + SEND, verified byte for byte) and rdma_cm_check.sh (rping) between
# two pod namespaces:
#
#   shared-macvlan  macvlan (bridge) of a common lower veth in each pod,
#                   Soft-RoCE created on the pod's own macvlan from inside the pod
#                   (rxe on the lower device drops RoCE arriving on an upper one)
#   shared-ipvlan   the same with ipvlan l2
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
OUR_RDMA_DEVS="rxm1 rxm2 rxi1 rxi2 rxp1 rxp2"
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

# rc_pair NAME: rc_exchange.py server in pod1, client in pod2; PASS when both
# sides exit 0 (the client only does when the server verified every byte)
rc_pair() {
    local name=$1 out=$WORK/${1//\//-} server_rc=0 client_rc=0 pid moved
    ip netns exec pod1 timeout -k 5 $((STEP_TIMEOUT + 30)) "$PYTHON" "$RC_EXCHANGE" server \
        --addr "$ADDR1" --timeout "$STEP_TIMEOUT" >"$out.server" 2>"$out.server.err" &
    pid=$!
    ip netns exec pod2 timeout -k 5 $((STEP_TIMEOUT + 30)) "$PYTHON" "$RC_EXCHANGE" client \
        --addr "$ADDR2" --peer "$ADDR1" --timeout "$STEP_TIMEOUT" \
        >"$out.client" 2>"$out.client.err" || client_rc=$?
    wait "$pid" || server_rc=$?
    cat "$out.server" "$out.server.err" "$out.client" "$out.client.err"
    keep rc_exchange "$out.server"; keep rc_exchange "$out.client"
    if [ "$server_rc" = 0 ] && [ "$client_rc" = 0 ]; then
        moved=$(grep -o '"bytes": [0-9]*' "$out.server" | grep -o '[0-9]*$')
        pass "$name" "($moved bytes verified; server $(grep -o '"transfer_s": [0-9.]*' "$out.server"))"
    else
        fail "$name" "(server exit $server_rc, client exit $client_rc)"
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

shared_layout() {
    local kind=$1 mode i
    mode=$([ "$kind" = macvlan ] && echo bridge || echo l2)
    run ip link add lower0 type veth peer name lower0p
    run ip link set lower0 up
    run ip link set lower0p up
    for i in 1 2; do
        run ip netns add "pod$i"
        run ip link add "sub$i" link lower0 type "$kind" mode "$mode"
        run ip link set "sub$i" netns "pod$i"
        pod_netdev "pod$i" "sub$i" "rx${kind:0:1}$i"
    done
    show_gids pod1 "rx${kind:0:1}1"
    run ip netns exec pod1 rdma res show qp || true
    traffic "shared-$kind"
    if rdma_cm_pair "$STEP_TIMEOUT"; then
        pass "shared-$kind/rdma-cm"
    else
        fail "shared-$kind/rdma-cm"
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

# enable_rxe_debug: rxe explains refused QPs only through dynamic debug
enable_rxe_debug() {
    mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug || true
    echo 'module rdma_rxe +p' >/sys/kernel/debug/dynamic_debug/control ||
        info exclusive/rxe-debug "dynamic debug unavailable: rxe's reasons will be missing"
}

# gsi_evidence SINCE: kernel lines about the GSI QP (QP1) after dmesg line SINCE
gsi_evidence() {
    dmesg | tail -n +"$1" | grep -E "GSI QP exists|ib_mad QP1|Couldn't open port|rxp[12]" || true
}

exclusive_layout() {
    local nics i mark evidence
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
    output_check exclusive/pod1-sees-own "rxp1" "rxp2" ip netns exec pod1 rdma dev
    output_check exclusive/pod2-sees-own "rxp2" "rxp1" ip netns exec pod2 rdma dev
    output_check exclusive/host-sees-neither "" "rxp" rdma dev
    show_gids pod1 rxp1
    run ip netns exec pod1 rdma res show qp || true
    traffic exclusive
    # rdma_cm: recorded, not required (see the header)
    if rdma_cm_pair 60; then
        info exclusive/rdma-cm "rping worked in exclusive mode on this kernel"
    else
        evidence=$(gsi_evidence "$mark")
        known exclusive/rdma-cm "rping fails in exclusive mode; kernel log since the moves:"
        # shellcheck disable=SC2001  # prefix every line
        sed 's/^/    dmesg: /' <<<"$evidence"
        if grep -q "GSI QP exists" <<<"$evidence"; then
            known exclusive/rdma-cm "cause: after 'rdma dev set ... netns' ib_mad cannot re-create QP1 (rxe says its GSI QP still exists): no CM MADs, so no rdma_cm connection"
        fi
    fi
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
    run_layout shared-macvlan shared_layout macvlan
    run_layout shared-ipvlan shared_layout ipvlan
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
