#!/usr/bin/env bash
# Fetch a Debian kernel with a working Soft-RoCE (rdma_rxe) and install the
# tools needed to boot it under QEMU with virtme-ng (vng).
#
# Why: the build/test machines have no RDMA NIC and their own kernel has no RDMA
# subsystem, and kernels before 7.3 cannot move rxe devices between network
# namespaces. Debian's trixie-backports suite ships 7.x kernels; we read that
# suite through a PRIVATE apt state so the system's own apt sources never change.
#
# Idempotent: when the kernel recorded in $CACHE/kernel.env is installed, a
# rerun only checks the host packages and prints the same result (no download).
# Set RDMA_NETNS_KERNEL_REFRESH=1 to look for a newer kernel in the suite.
#
# Env:
#   RDMA_NETNS_KERNEL_CACHE    cache folder (default /var/cache/rdma-netns-kernel)
#   RDMA_NETNS_KERNEL_REFRESH  1 = re-read the suite and upgrade if newer
#   RDMA_NETNS_KERNEL_SUITE    suite to read (default trixie-backports)
#   RDMA_NETNS_KERNEL_MIN      lowest acceptable major.minor (default 7.3)
#   RDMA_NETNS_ALLOW_UNSIGNED  1 = last resort, read the suite unverified (see below)
#
# Output: last line is KERNEL=<path to vmlinuz>; the same (plus VNG= and
# KERNEL_VERSION=) is written to $CACHE/kernel.env for run-in-guest.sh.
set -euo pipefail

CACHE=${RDMA_NETNS_KERNEL_CACHE:-/var/cache/rdma-netns-kernel}
SUITE=${RDMA_NETNS_KERNEL_SUITE:-trixie-backports}
MIN=${RDMA_NETNS_KERNEL_MIN:-7.3}
ENV_FILE=$CACHE/kernel.env
# virtme-ng comes from PyPI; Debian 12's python is "externally managed" (PEP 668),
# so it goes into its own venv built on Debian's /usr/bin/python3. That venv must
# stay readable from the guest (the guest init script lives inside it), which it
# is: the guest sees the host's root filesystem.
VENV=$CACHE/vng-venv
VNG=$VENV/bin/vng
VNG_VERSION=1.42

log() { echo "fetch-kernel: $*" >&2; }
die() { echo "fetch-kernel: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (installs packages and /lib/modules/<ver>)"
mkdir -p "$CACHE"

# Serialise concurrent runs (CI and a developer, or two test jobs) on the cache.
exec 9>"$CACHE/.lock"
flock 9

# ---------------------------------------------------------------- host packages
# qemu-system-x86: the VM; kmod: depmod/modprobe; busybox-static: virtme's guest
# helpers and `busybox ping` (no ping binary otherwise); rdma-core & co: the
# userspace the guest runs (it shares the host's root filesystem);
# python3-venv: for the virtme-ng venv.
HOST_PKGS=(qemu-system-x86 kmod busybox-static rdma-core ibverbs-utils rdmacm-utils
           perftest python3-pyverbs iproute2 python3-venv)
missing=()
for p in "${HOST_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Only refresh the system's package lists when they cannot serve the install
    # (never updated on a fresh machine, or stale so a file is gone).
    need_update=0
    for p in "${missing[@]}"; do
        apt-cache show "$p" >/dev/null 2>&1 || { need_update=1; break; }
    done
    [ $need_update = 1 ] && apt-get update -qq
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
        [ $need_update = 1 ] && die "apt-get install failed"
        log "install failed, refreshing package lists and retrying"
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    fi
fi

if [ ! -x "$VNG" ] || ! "$VENV/bin/pip" show virtme-ng 2>/dev/null | grep -qx "Version: $VNG_VERSION"; then
    log "installing virtme-ng $VNG_VERSION into $VENV"
    rm -rf "$VENV"
    /usr/bin/python3 -m venv "$VENV"
    # Pinned: run-in-guest.sh relies on this release's flags (--disable-kvm, --rwdir, --network
    # loop, --exec); raise it deliberately, with a suite run.
    "$VENV/bin/pip" install -q "virtme-ng==$VNG_VERSION" >&2
fi
[ -x "$VNG" ] || die "virtme-ng install failed: $VNG missing"
# The guest's root is the host's, over 9p when virtiofsd is missing (Debian 12 has none virtme-ng
# can drive), and virtme-ng mounts it without a cache: every file read, every Python start and
# import, crosses to QEMU again (about 3 MB/s under TCG). The guests only read that root (what they
# write goes to overlays, and the --rwdir folders keep their own uncached mounts), so the root is
# mounted cache=loose: measured in a guest, `python -S -c pass` 1.7 -> 0.8 s, importing pydantic
# 21 -> 2.8 s, loading the config model 35 -> 5.4 s (docs/testing.md). Idempotent; a reinstall of
# virtme-ng gets it again.
VNG_INITRAMFS=$("$VENV/bin/python3" -c 'import virtme.mkinitramfs as m; print(m.__file__)')
if ! grep -q 'msize=524288,cache=loose /dev/root' "$VNG_INITRAMFS"; then
    grep -q 'msize=524288 /dev/root' "$VNG_INITRAMFS" ||
        die "virtme-ng $VNG_VERSION: the 9p root mount line in $VNG_INITRAMFS is not the expected one"
    sed -i 's|msize=524288 /dev/root|msize=524288,cache=loose /dev/root|' "$VNG_INITRAMFS"
    log "virtme-ng: the guest root's 9p mount is cached (cache=loose)"
fi
# vng starts its helpers (virtme-run, ...) through PATH, so callers must put
# $VENV/bin first on PATH; also offer a plain `vng` command if none exists.
if [ ! -e /usr/local/bin/vng ] || [ "$(readlink /usr/local/bin/vng)" = "$VENV/bin/vng-wrapper" ]; then
    cat > "$VENV/bin/vng-wrapper" <<EOF
#!/bin/sh
# Generated by fetch-kernel.sh: run vng with its helpers on PATH.
PATH="$VENV/bin:\$PATH" exec "$VNG" "\$@"
EOF
    chmod +x "$VENV/bin/vng-wrapper"
    ln -sfn "$VENV/bin/vng-wrapper" /usr/local/bin/vng
fi

# ------------------------------------------------------ already installed? done
installed_ok() {  # $1 = kernel version
    [ -s "/lib/modules/$1/vmlinuz" ] && [ -s "/lib/modules/$1/modules.dep" ] &&
        [ -s "/lib/modules/$1/modules.builtin" ]
}
if [ "${RDMA_NETNS_KERNEL_REFRESH:-0}" != 1 ] && [ -s "$ENV_FILE" ]; then
    KVER=$(sed -n 's/^KERNEL_VERSION=//p' "$ENV_FILE")
    if [ -n "$KVER" ] && installed_ok "$KVER"; then
        log "kernel $KVER already installed (RDMA_NETNS_KERNEL_REFRESH=1 to look for a newer one)"
        echo "VNG=$VNG"
        echo "KERNEL=/lib/modules/$KVER/vmlinuz"
        exit 0
    fi
fi

# ------------------------------------------------------------ private apt state
# shellcheck source=../../scripts/private-apt.sh
. "$(dirname "$0")/../../scripts/private-apt.sh"

# -------------------------------------------------------- newest 7.x >= $MIN
# Package names: linux-binary-<ver> holds vmlinuz, linux-modules-<ver> the
# modules, linux-base-<ver> modules.builtin/order and config (depmod and
# modprobe need those). linux-image-<ver> is only a meta package.
# <ver> looks like 7.3.4+deb13-amd64; skip the -cloud-amd64 / -rt-amd64 flavours
# (cloud lacks many drivers).
KVER=$(apt-cache "${APT_OPTS[@]}" pkgnames linux-binary- |
    sed -n 's/^linux-binary-\(7\.[0-9]\+\.[0-9]\++deb[0-9]\+-amd64\)$/\1/p' |
    awk -v min="$MIN" '{ split($0, v, /[.+]/); split(min, m, "."); \
        if (v[1] > m[1] || (v[1] == m[1] && v[2] >= m[2])) print }' |
    sort -V | tail -n1)
[ -n "$KVER" ] || die "no linux-binary-7.x (>= $MIN) amd64 kernel in $SUITE"
PKGS=("linux-binary-$KVER" "linux-modules-$KVER" "linux-base-$KVER")
for p in "${PKGS[@]}"; do
    apt-cache "${APT_OPTS[@]}" show "$p" >/dev/null 2>&1 || die "package $p not in $SUITE"
done
log "newest kernel in $SUITE: $KVER"

if installed_ok "$KVER"; then
    log "kernel $KVER already installed"
else
    # ------------------------------------------------------- download (cached)
    DEBS=$CACHE/debs
    mkdir -p "$DEBS"
    have_all=1
    for p in "${PKGS[@]}"; do
        ls "$DEBS/${p}_"*.deb >/dev/null 2>&1 || have_all=0
    done
    if [ $have_all = 0 ]; then
        # download into a scratch folder, move in only when complete; apt drops
        # privileges to _apt for downloads, so let it write there.
        rm -rf "$DEBS/.tmp" && mkdir -p "$DEBS/.tmp"
        chown _apt "$DEBS/.tmp" 2>/dev/null || true
        log "downloading ${PKGS[*]}"
        t0=$(date +%s)
        ( cd "$DEBS/.tmp" && apt-get "${APT_OPTS[@]}" download -q "${PKGS[@]}" >&2 )
        # drop cached debs of other kernel versions, keep the new ones
        find "$DEBS" -maxdepth 1 -name 'linux-*.deb' -delete
        mv "$DEBS/.tmp/"*.deb "$DEBS/"
        rmdir "$DEBS/.tmp"
        log "downloaded $(du -ch "$DEBS"/*.deb | tail -n1 | cut -f1) in $(( $(date +%s) - t0 )) s"
    fi

    # ------------------------------------------ unpack, install, depmod
    STAGE=$CACHE/stage
    rm -rf "$STAGE" && mkdir -p "$STAGE"
    for p in "${PKGS[@]}"; do
        debs=("$DEBS/${p}_"*.deb)
        dpkg -x "${debs[0]}" "$STAGE"
    done
    SRC=$STAGE/usr/lib/modules/$KVER
    [ -s "$SRC/vmlinuz" ] || SRC=$STAGE/lib/modules/$KVER   # older layout
    [ -s "$SRC/vmlinuz" ] || die "no vmlinuz in the unpacked packages"
    mkdir -p /lib/modules
    rm -rf "/lib/modules/$KVER.new" "/lib/modules/$KVER"
    # /lib is usually a symlink to /usr/lib: moving inside one filesystem is cheap
    mv "$SRC" "/lib/modules/$KVER.new"
    mv "/lib/modules/$KVER.new" "/lib/modules/$KVER"
    rm -rf "$STAGE"
    log "depmod -a $KVER"
    depmod -a "$KVER"
    installed_ok "$KVER" || die "kernel $KVER install incomplete"
fi

cat > "$ENV_FILE.tmp" <<EOF
KERNEL_VERSION=$KVER
KERNEL=/lib/modules/$KVER/vmlinuz
VNG=$VNG
EOF
mv "$ENV_FILE.tmp" "$ENV_FILE"
echo "VNG=$VNG"
echo "KERNEL=/lib/modules/$KVER/vmlinuz"
