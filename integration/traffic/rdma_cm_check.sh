#!/usr/bin/env bash
# rping (librdmacm: address/route resolution, CM connect, RDMA READ/WRITE and
# SEND with data validation) between two pods over their IPv6 addresses.
#
#   rdma_cm_check.sh --server-addr ADDR [--server-netns NS]
#                    [--client-addr ADDR] [--client-netns NS]
#                    [--count N] [--size BYTES] [--port P] [--timeout S]
#
# The server runs in the background (in NS with `ip netns exec`, or in the
# current netns when no NS is given), the client connects from --client-addr
# and pings --count times with -V (each buffer checked) and -v (each buffer
# printed, so the pings can be counted). rping has no way to say "listening",
# so the client retries while the server is alive. Everything is bounded by
# --timeout (default 120 s, the whole check).
#
# Prints one JSON line with the result. Exit codes: 0 both sides finished
# --count validated pings; 1 rping failed or pinged fewer times; 2 usage;
# 124 timeout.
set -euo pipefail

SERVER_NS="" CLIENT_NS="" SERVER_ADDR="" CLIENT_ADDR="" SERVER_PID=""
COUNT=10 SIZE=256 PORT=7174 TIMEOUT=120

usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0" >&2; exit 2; }

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            --server-netns) SERVER_NS=${2?}; shift 2 ;;
            --client-netns) CLIENT_NS=${2?}; shift 2 ;;
            --server-addr) SERVER_ADDR=${2:?}; shift 2 ;;
            --client-addr) CLIENT_ADDR=${2:?}; shift 2 ;;
            --count) COUNT=${2:?}; shift 2 ;;
            --size) SIZE=${2:?}; shift 2 ;;
            --port) PORT=${2:?}; shift 2 ;;
            --timeout) TIMEOUT=${2:?}; shift 2 ;;
            -h|--help) usage ;;
            *) echo "rdma_cm_check: unknown argument $1" >&2; usage ;;
        esac
    done
    [ -n "$SERVER_ADDR" ] || { echo "rdma_cm_check: --server-addr is required" >&2; usage; }
    for n in "$COUNT" "$SIZE" "$PORT" "$TIMEOUT"; do
        [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "rdma_cm_check: $n is not a positive integer" >&2; usage; }
    done
}

# ns_prefix NS: the words that run a command in netns NS (none for "here").
# A prefix rather than a wrapper function: `ip netns exec` and `timeout` exec
# in place, so $! of a background job is the timeout process and killing it
# stops rping too.
ns_prefix() { [ -z "$1" ] || echo "ip netns exec $1"; }

now() { date +%s.%N; }
seconds_left() { awk -v end="$END" -v now="$(now)" 'BEGIN { l = end - now; print (l > 0 ? int(l) : 0) }'; }

# count_pings FILE PREFIX: validated pings rping -v printed with PREFIX
count_pings() { grep -c "^$2ping data: rdma-ping-" "$1" || true; }

# report OK RC: the JSON result line, and both logs on stderr when not OK
report() {
    local ok=$1 rc=$2 elapsed
    elapsed=$(awk -v t0="$T0" -v t1="$(now)" 'BEGIN { printf "%.2f", t1 - t0 }')
    printf '{"tool": "rdma_cm_check", "ok": %s, "exit": %d, "server": "%s", "client": "%s", "count": %d, "size": %d, "client_pings": %d, "server_pings": %d, "attempts": %d, "elapsed_s": %s}\n' \
        "$ok" "$rc" "$SERVER_ADDR" "${CLIENT_ADDR:-any}" "$COUNT" "$SIZE" \
        "$(count_pings "$WORK/client.log" "")" "$(count_pings "$WORK/server.log" "server ")" \
        "$ATTEMPTS" "$elapsed"
    if [ "$ok" != true ]; then
        { echo "--- rping server log (tail)"; tail -n 15 "$WORK/server.log"
          echo "--- rping client log (tail)"; tail -n 15 "$WORK/client.log"; } >&2
    fi
}

start_server() {
    local prefix
    read -ra prefix <<<"$(ns_prefix "$SERVER_NS")"
    "${prefix[@]}" timeout -k 5 "$TIMEOUT" \
        rping -s -a "$SERVER_ADDR" -p "$PORT" -C "$COUNT" -S "$SIZE" -v -V >"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
}

# run_client: retry until the server listens; returns the last client exit
run_client() {
    local rc=1 left bind=() prefix
    read -ra prefix <<<"$(ns_prefix "$CLIENT_NS")"
    [ -n "$CLIENT_ADDR" ] && bind=(-I "$CLIENT_ADDR")
    while left=$(seconds_left) && [ "$left" -gt 0 ]; do
        ATTEMPTS=$((ATTEMPTS + 1))
        rc=0
        "${prefix[@]}" timeout -k 5 "$left" \
            rping -c -a "$SERVER_ADDR" "${bind[@]}" -p "$PORT" -C "$COUNT" -S "$SIZE" -v -V \
            >"$WORK/client.log" 2>&1 || rc=$?
        # a client that pinged at all reached the listener: its result is final
        [ "$rc" = 0 ] || [ "$(count_pings "$WORK/client.log" "")" -gt 0 ] && break
        [ "$rc" = 124 ] && break
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    return "$rc"
}

main() {
    parse_args "$@"
    WORK=$(mktemp -d)
    # errexit also runs in the trap: a kill that finds nothing must not set the exit code
    trap 'kill "$SERVER_PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT
    T0=$(now)
    END=$(awk -v t0="$T0" -v t="$TIMEOUT" 'BEGIN { printf "%.3f", t0 + t }')
    ATTEMPTS=0
    start_server
    local client_rc=0 server_rc=0
    run_client || client_rc=$?
    # the server ends on its own after COUNT pings; a failed client leaves it waiting
    [ "$client_rc" = 0 ] || kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" || server_rc=$?
    if [ "$client_rc" = 0 ] && [ "$server_rc" = 0 ] &&
       [ "$(count_pings "$WORK/client.log" "")" = "$COUNT" ] &&
       [ "$(count_pings "$WORK/server.log" "server ")" = "$COUNT" ]; then
        report true 0
        return 0
    fi
    local rc=1
    { [ "$client_rc" = 124 ] || [ "$server_rc" = 124 ]; } && rc=124
    report false "$rc"
    return "$rc"
}

main "$@"
