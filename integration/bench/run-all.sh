#!/usr/bin/env bash
# Run every rdma-netns benchmark (issue 6) and print the results; the figures also go to JSON files.
#
#   integration/bench/run-all.sh            # default sizes, about 5 minutes on 2 cores
#   integration/bench/run-all.sh --quick    # smoke sizes, about 1 minute
#   integration/bench/run-all.sh --full     # default sizes + the 2000-cycle churn (~10 min more)
#
# Runs, in order:
#   cni_add_del.py  single ADD/DEL, 1 and 8 rails, against Go macvlan IPv4/IPv6 (30 runs each)
#   burst.py        64 pods x 8 rails ADDed then DELeted at once, against Go macvlan (8 calls a pod)
#   churn.py        200 (--full: 2000) ADD/DEL cycles of 8-rail pods, then the leak checks
#   dp_bench.py     the device plugin benchmark, when that script is present
#
# Needs root, iproute2, strace, GNU time (/usr/bin/time) and Debian's containernetworking-plugins
# (/usr/lib/cni). Environment: RDMA_NETNS (default .venv/bin/rdma-netns: the install measured),
# PYTHON (default .venv/bin/python), OUT (folder for the JSON files, default /tmp/rdma-netns-bench-<time>).
# Exit status: 0 when every benchmark ran and passed its own checks (zero errors, no leaks).

set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BENCH="$REPO/integration/bench"
RDMA_NETNS=${RDMA_NETNS:-$REPO/.venv/bin/rdma-netns}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
OUT=${OUT:-/tmp/rdma-netns-bench-$(date +%Y%m%d-%H%M%S)}
MODE=default
case "${1:-}" in
  --quick) MODE=quick ;;
  --full) MODE=full ;;
  "") ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac

if [ "$(id -u)" != 0 ]; then echo "run as root (the benchmarks create network namespaces)" >&2; exit 2; fi
for tool in ip strace /usr/bin/time /usr/lib/cni/macvlan /usr/lib/cni/host-local "$RDMA_NETNS" "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 2; }
done
mkdir -p "$OUT"

case $MODE in
  quick)   ITER=10; BURST=(--pods 16 --go-families ipv4 --lone 5); CHURN=(--cycles 50) ; DP=(--quick) ;;
  default) ITER=30; BURST=();                                      CHURN=(--quick)     ; DP=(--quick) ;;
  full)    ITER=30; BURST=();                                      CHURN=(--cycles 2000); DP=() ;;
esac

declare -A STATUS
run() {  # run NAME CMD...: print a header, run, remember the exit status and the time
  local name=$1; shift
  echo; echo "=================== $name: $*"
  local start=$SECONDS
  "$@"
  local rc=$?
  STATUS[$name]="exit $rc, $((SECONDS - start)) s"
}

echo "rdma-netns benchmarks ($MODE) on $(nproc) CPUs, kernel $(uname -r), results in $OUT"
"$RDMA_NETNS" --version 2>/dev/null || true
run cni_add_del "$PYTHON" "$BENCH/cni_add_del.py" --rdma-netns "$RDMA_NETNS" --iterations "$ITER" \
  --json "$OUT/cni_add_del.json"
run burst "$PYTHON" "$BENCH/burst.py" --rdma-netns "$RDMA_NETNS" "${BURST[@]}" --json "$OUT/burst.json"
run churn "$PYTHON" "$BENCH/churn.py" --rdma-netns "$RDMA_NETNS" "${CHURN[@]}" --json "$OUT/churn.json"
if [ -f "$BENCH/dp_bench.py" ]; then
  run dp_bench "$PYTHON" "$BENCH/dp_bench.py" "${DP[@]}" --json "$OUT/dp_bench.json"
fi

echo; echo "=================== summary ($MODE, total $SECONDS s; JSON in $OUT)"
rc=0
for name in cni_add_del burst churn dp_bench; do
  [ -n "${STATUS[$name]:-}" ] || continue
  echo "$name: ${STATUS[$name]}"
  case ${STATUS[$name]} in "exit 0,"*) ;; *) rc=1 ;; esac
done
exit $rc
