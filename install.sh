#!/usr/bin/env bash
# Install rdma-netns on a node, idempotently, and uninstall exactly what was installed.
#
#   ./install.sh [--conflist conf/rdma-netns-shared-1rail.conflist] [--persist-mode shared|exclusive]
#   ./install.sh --chain-into-primary conf/rdma-netns-chained-entry.json   (chained, like istio-cni)
#   ./install.sh --uninstall
#
# What it puts where (each path can be moved with a flag; --root DIR prefixes all of them):
#   /opt/rdma-netns/            a virtual environment with rdma-netns and rdma-netns-dp installed
#   /opt/cni/bin/rdma-netns     the launcher a container runtime executes (python -IS, this venv)
#   /etc/cni/net.d/<conflist>   the network config, only if no file of that name exists (or --force)
#   /etc/modprobe.d/rdma-netns.conf   with --persist-mode: the kernel RDMA netns mode at boot
#   /etc/cni/net.d/<primary>    with --chain-into-primary: our entry at the end of its plugins
#   /opt/rdma-netns/install-manifest  what this script created, so --uninstall removes only that
set -euo pipefail

SRC=$(cd "$(dirname "$0")" && pwd)
ROOT=/
PREFIX=/opt/rdma-netns
CNI_BIN_DIR=/opt/cni/bin
CNI_CONF_DIR=/etc/cni/net.d
CONFLIST=
FORCE=0
PERSIST_MODE=
UNINSTALL=0
DRY_RUN=0
CHAIN_ENTRY=
RDMA_PODS=
CNI_CONF_STATE_DIR=/var/lib/rdma-netns/cni-conf
PYTHON=${PYTHON:-python3}

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  cat <<EOF

options:
  --conflist FILE        network config to install into the CNI config folder (default: none)
  --force                replace an existing config file of the same name
  --chain-into-primary ENTRY
                         insert the plugin entry ENTRY (a JSON object, e.g.
                         conf/rdma-netns-chained-entry.json) at the end of the plugins of the node's
                         primary CNI config (the first file of the CNI config folder, which the
                         cluster CNI owns); --uninstall leaves that file byte-for-byte as it was
  --rdma-pods on|off     "RDMA for non-hostNetwork pods": on (the default when --conflist or
                         --chain-into-primary is given) installs that network config; off installs
                         the device plugin side only and takes out a network config an earlier run
                         installed (the chained entry, or an unchanged --conflist file)
  --cni-conf-state-dir DIR  where --chain-into-primary keeps the primary's original bytes
                         (default $CNI_CONF_STATE_DIR)
  --persist-mode MODE    write the boot-time RDMA netns mode (shared|exclusive) to modprobe.d,
                         and set it now if no other network namespace exists
  --prefix DIR           virtual environment folder (default $PREFIX)
  --cni-bin-dir DIR      CNI plugin folder the runtime searches (default $CNI_BIN_DIR)
  --cni-conf-dir DIR     CNI config folder (default $CNI_CONF_DIR)
  --python PYTHON        interpreter for the venv, 3.11 or newer (default python3)
  --root DIR             install under DIR instead of / (for images and tests)
  --dry-run              print what would be done, change nothing
  --uninstall            remove what an earlier install added (per its manifest)
EOF
}

die() { echo "install.sh: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --conflist) CONFLIST=${2:?}; shift ;;
    --force) FORCE=1 ;;
    --chain-into-primary) CHAIN_ENTRY=${2:?}; shift ;;
    --rdma-pods) RDMA_PODS=${2:?}; shift ;;
    --cni-conf-state-dir) CNI_CONF_STATE_DIR=${2:?}; shift ;;
    --persist-mode) PERSIST_MODE=${2:?}; shift ;;
    --prefix) PREFIX=${2:?}; shift ;;
    --cni-bin-dir) CNI_BIN_DIR=${2:?}; shift ;;
    --cni-conf-dir) CNI_CONF_DIR=${2:?}; shift ;;
    --python) PYTHON=${2:?}; shift ;;
    --root) ROOT=${2:?}; shift ;;
    --dry-run) DRY_RUN=1 ;;
    --uninstall) UNINSTALL=1 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
  shift
done

case "$PERSIST_MODE" in ""|shared|exclusive) ;; *) die "--persist-mode must be shared or exclusive" ;; esac
case "$RDMA_PODS" in
  "") [ -z "$CONFLIST$CHAIN_ENTRY" ] || RDMA_PODS=on ;;
  on) [ -n "$CONFLIST$CHAIN_ENTRY" ] \
        || die "--rdma-pods on: say which network config, --chain-into-primary ENTRY or --conflist FILE" ;;
  off) [ -z "$CONFLIST$CHAIN_ENTRY" ] \
        || die "--rdma-pods off installs no network config: drop --conflist / --chain-into-primary" ;;
  *) die "--rdma-pods must be on or off" ;;
esac
[ -d "$ROOT" ] || die "--root $ROOT is not a folder"
ROOT=$(cd "$ROOT" && pwd)
at() { if [ "$ROOT" = / ]; then echo "$1"; else echo "$ROOT$1"; fi; }
VENV=$(at "$PREFIX")
MANIFEST="$VENV/install-manifest"
BIN_DEST=$(at "$CNI_BIN_DIR")/rdma-netns
MODPROBE=$(at /etc/modprobe.d/rdma-netns.conf)
CONF_DIR_AT=$(at "$CNI_CONF_DIR")
STATE_AT=$(at "$CNI_CONF_STATE_DIR")

run() {  # run a command, or show it under --dry-run
  if [ "$DRY_RUN" = 1 ]; then echo "would run: $*"; else "$@"; fi
}

# The manifest lists "file <path> <sha256>" and "dir <path>" lines for what this script created,
# and "chain <conf-dir> <state-dir>" when our entry was inserted into the primary CNI config.
record() { [ "$DRY_RUN" = 1 ] || echo "$*" >>"$MANIFEST.new"; }
unrecord() {  # forget the records of kind $1 for path $2
  [ "$DRY_RUN" = 1 ] && return 0
  awk -v k="$1" -v p="$2" '!($1 == k && $2 == p)' "$MANIFEST.new" >"$MANIFEST.new2"
  mv "$MANIFEST.new2" "$MANIFEST.new"
}
finish_manifest() {  # also on an error exit: what was done so far stays recorded
  [ "$DRY_RUN" = 0 ] && [ -f "$MANIFEST.new" ] || return 0
  # One line per path: the newest record wins (a re-install may have replaced a file).
  tac "$MANIFEST.new" | awk '!seen[$1" "$2]++' | tac >"$MANIFEST.tmp"
  mv "$MANIFEST.tmp" "$MANIFEST"; rm -f "$MANIFEST.new"
  chmod 0644 "$MANIFEST"
}

make_dir() {  # create a folder (and its missing parents), recording the ones we created
  local dir=$1 missing=() d
  d=$dir
  while [ ! -d "$d" ]; do missing=("$d" "${missing[@]}"); d=$(dirname "$d"); done
  for d in "${missing[@]}"; do
    run mkdir -m 0755 "$d"
    record "dir $d"
  done
}

uninstall() {
  [ -f "$MANIFEST" ] || { say "nothing to uninstall: no manifest at $MANIFEST"; exit 0; }
  local kind path sum dirs=()
  while read -r kind path sum; do
    case "$kind" in
      file)
        if [ ! -e "$path" ]; then continue; fi
        if [ -n "$sum" ] && [ "$(sha256sum "$path" | cut -d' ' -f1)" != "$sum" ]; then
          say "keeping $path: it was changed after install"
          continue
        fi
        run rm -f "$path"; say "removed $path" ;;
      dir) dirs=("$path" "${dirs[@]}") ;;
      chain)  # our entry in the primary CNI config: the primary goes back to its own bytes
        run "$VENV/bin/rdma-netns" cni-conf remove --conf-dir "$path" --state-dir "$sum" ;;
    esac
  done <"$MANIFEST"
  run rm -rf "$VENV"; say "removed $VENV"
  for path in "${dirs[@]}"; do  # deepest first; only if we made it and it is empty now
    [ "$path" = "$VENV" ] && continue
    if [ -d "$path" ] && [ -z "$(ls -A "$path")" ]; then run rmdir "$path"; say "removed $path"; fi
  done
  exit 0
}

[ "$UNINSTALL" = 1 ] && uninstall

# --- install ---------------------------------------------------------------------------------
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "$PYTHON is not Python 3.11 or newer (use --python)"
# Refuse before changing anything: never clobber what someone else put there.
[ -z "$CHAIN_ENTRY" ] || [ -f "$CHAIN_ENTRY" ] || die "--chain-into-primary $CHAIN_ENTRY does not exist"
if [ -n "$CONFLIST" ]; then
  [ -f "$CONFLIST" ] || die "--conflist $CONFLIST does not exist"
  dest=$(at "$CNI_CONF_DIR")/$(basename "$CONFLIST")
  if [ -e "$dest" ] && ! cmp -s "$CONFLIST" "$dest" && [ "$FORCE" = 0 ]; then
    die "$dest exists and differs: not replacing it (use --force)"
  fi
fi
if [ -e "$BIN_DEST" ] && [ "$FORCE" = 0 ] && ! grep -qs "^file $BIN_DEST\$" "$MANIFEST"; then
  die "$BIN_DEST exists and was not installed by this script: not replacing it (use --force)"
fi

venv_parents=()
d=$VENV
while [ ! -d "$d" ]; do venv_parents=("$d" "${venv_parents[@]}"); d=$(dirname "$d"); done
run mkdir -p -m 0755 "$VENV"
if [ "$DRY_RUN" = 0 ]; then
  : >"$MANIFEST.new"
  # Keep the records of an earlier install (a re-run must still let --uninstall remove everything).
  [ -f "$MANIFEST" ] && cat "$MANIFEST" >>"$MANIFEST.new"
  for d in "${venv_parents[@]}"; do record "dir $d"; done
  trap finish_manifest EXIT
fi

if [ ! -x "$VENV/bin/python" ]; then
  run "$PYTHON" -m venv "$VENV"
fi
say "installing rdma-netns from $SRC into $VENV"
# setuptools builds in $SRC/build: a stale one would ship modules this checkout no longer has.
run rm -rf "$SRC/build"
run "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$SRC"
run "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$SRC"

make_dir "$(dirname "$BIN_DEST")"
run "$VENV/bin/rdma-netns" install-launcher "$BIN_DEST"
record "file $BIN_DEST"
say "CNI executable: $BIN_DEST"

if [ -n "$CONFLIST" ]; then
  dest=$(at "$CNI_CONF_DIR")/$(basename "$CONFLIST")
  run "$VENV/bin/rdma-netns" check-config "$CONFLIST" >/dev/null
  make_dir "$(dirname "$dest")"
  if [ -e "$dest" ] && cmp -s "$CONFLIST" "$dest"; then
    say "$dest is already installed"
  else
    run install -m 0644 "$CONFLIST" "$dest"
    [ "$DRY_RUN" = 1 ] || record "file $dest $(sha256sum "$dest" | cut -d' ' -f1)"
    say "network config: $dest"
  fi
fi

if [ -n "$CHAIN_ENTRY" ]; then
  make_dir "$(dirname "$STATE_AT")"
  [ -d "$STATE_AT" ] || record "dir $STATE_AT"   # cni-conf makes it, 0700
  run "$VENV/bin/rdma-netns" cni-conf insert --conf-dir "$CONF_DIR_AT" --entry "$CHAIN_ENTRY" \
    --state-dir "$STATE_AT"
  record "chain $CONF_DIR_AT $STATE_AT"
  if [ "$DRY_RUN" = 0 ] && [ "$("$VENV/bin/rdma-netns" cni-conf show --conf-dir "$CONF_DIR_AT" \
       --state-dir "$STATE_AT" | sed -n 's/^entry: //p')" != present ]; then
    say "no primary CNI config in $CONF_DIR_AT yet: run this again once the cluster CNI wrote it," \
        "or run \`rdma-netns cni-conf watch\` as a service (it waits, and re-inserts after rewrites)"
  fi
fi

if [ "$RDMA_PODS" = off ] && [ -f "$MANIFEST" ]; then
  # Device plugin only: take out the network config an earlier run installed.
  while read -r kind path sum; do
    case "$kind" in
      chain)
        run "$VENV/bin/rdma-netns" cni-conf remove --conf-dir "$path" --state-dir "$sum"
        unrecord chain "$path" ;;
      file)
        [ "$(dirname "$path")" = "$CONF_DIR_AT" ] || continue
        if [ -e "$path" ] && [ "$(sha256sum "$path" | cut -d' ' -f1)" = "$sum" ]; then
          run rm -f "$path"; say "removed $path"
        elif [ -e "$path" ]; then
          say "keeping $path: it was changed after install"
        fi
        unrecord file "$path" ;;
    esac
  done <"$MANIFEST"
fi

if [ -n "$PERSIST_MODE" ]; then
  make_dir "$(dirname "$MODPROBE")"
  live=(); [ "$ROOT" = / ] || live=(--persist-only)
  run "$VENV/bin/rdma-netns" mode set "$PERSIST_MODE" --persist --modprobe-file "$MODPROBE" "${live[@]}"
  [ "$DRY_RUN" = 1 ] || record "file $MODPROBE $(sha256sum "$MODPROBE" | cut -d' ' -f1)"
fi

finish_manifest
say "done: $("$VENV/bin/rdma-netns" --version 2>/dev/null || echo rdma-netns), $("$VENV/bin/rdma-netns-dp" --version 2>/dev/null || true)"
