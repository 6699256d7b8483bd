#!/bin/sh
# Records what a container runtime sends to a CNI plugin, then runs the plugin itself.
#
# Install it in the runtime's CNI plugin folder under the plugin's name (e.g. <dir>/rdma-netns),
# with the real executable beside it as <name>.real (e.g. from `rdma-netns install-launcher
# <dir>/rdma-netns.real`). Each call gets a folder <dir>/../cni-calls/<ns-time>-<pid>-<command>/:
#   env        the CNI_* variables, sorted
#   env-names  the names (only) of every variable the runtime passed
#   stdin      the exact bytes of the network config the runtime sent
# and the plugin then reads those same bytes. Stdout, stderr and the exit code are the plugin's.
call="$(dirname "$0")/../cni-calls/$(date +%s%N)-$$-${CNI_COMMAND:-none}"
if mkdir -p "$call"; then
  env | grep '^CNI_' | sort > "$call/env"
  env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' | sort > "$call/env-names"
  cat > "$call/stdin"
  exec "$0.real" < "$call/stdin"
fi
exec "$0.real"
