#!/usr/bin/env bash
# containerd 1.7 for the CRI suites, from Debian 13 (trixie) read through a private apt state (as
# integration/guest/fetch-kernel.sh reads trixie-backports): the system's sources never change,
# and Debian 12's containerd 1.6 stays the machine's. The package's binaries (containerd,
# containerd-shim-runc-v2, ctr) go to $DEST/bin; they run on Debian 12 with its runc.
#
# Idempotent: does nothing when $DEST/bin/containerd already reports 1.7. Last line: DEST=<folder>.
#
# Env: RDMA_NETNS_CONTAINERD17_DIR (default /opt/rdma-netns-test/containerd-1.7),
#      RDMA_NETNS_CRI_CACHE (default /var/cache/rdma-netns-cri)
set -euo pipefail

DEST=${RDMA_NETNS_CONTAINERD17_DIR:-/opt/rdma-netns-test/containerd-1.7}
CACHE=${RDMA_NETNS_CRI_CACHE:-/var/cache/rdma-netns-cri}/trixie
SUITE=trixie
WANT=1.7

log() { echo "fetch-containerd: $*" >&2; }
die() { echo "fetch-containerd: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

have() { "$DEST/bin/containerd" --version 2>/dev/null | grep -q " v\?$WANT\."; }
if have; then
    log "$("$DEST/bin/containerd" --version) already in $DEST"
    echo "DEST=$DEST"
    exit 0
fi

# shellcheck source=../../scripts/private-apt.sh
. "$(dirname "$0")/../../scripts/private-apt.sh"

version=$(apt-cache "${APT_OPTS[@]}" show containerd 2>/dev/null | sed -n 's/^Version: //p' | sort -V | tail -n1)
[ -n "$version" ] || die "no containerd package in $SUITE"
case "$version" in "$WANT".*) ;; *) die "$SUITE's containerd is $version, not $WANT.x" ;; esac
log "containerd $version from $SUITE"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chown _apt "$work" 2>/dev/null || true
( cd "$work" && apt-get "${APT_OPTS[@]}" download -q "containerd=$version" >&2 )
dpkg -x "$work"/containerd_*.deb "$work/x"
mkdir -p "$DEST/bin.partial"
for tool in containerd containerd-shim-runc-v2 ctr; do
    install -m 0755 "$work/x/usr/bin/$tool" "$DEST/bin.partial/$tool"
done
rm -rf "$DEST/bin" && mv "$DEST/bin.partial" "$DEST/bin"
have || die "$DEST/bin/containerd does not report $WANT: $("$DEST/bin/containerd" --version 2>&1)"
log "$("$DEST/bin/containerd" --version)"
echo "DEST=$DEST"
