#!/bin/sh
# Records what containerd's CRI sends to a CNI plugin and how long the plugin took, then answers
# with the plugin's own output and exit code.
#
# Installed in containerd's CNI bin_dir under the plugin's name (<dir>/rdma-netns), with the real
# executable beside it as <name>.real (`rdma-netns install-launcher <dir>/rdma-netns.real`). Each
# call gets a folder <dir>/../cni-calls/<ns-time>-<pid>-<command>/:
#   env        the CNI_* variables, sorted
#   env-names  the names (only) of every variable the runtime passed
#   stdin      the exact bytes of the network config the runtime sent
#   start/end  nanosecond clock just before the plugin starts and just after it exits
#   rc, stdout the plugin's exit code and output (stderr passes straight through)
#   times      the shell's `times`: line 2 is the CPU time (user, system) of its children, i.e.
#              the plugin (and two `date`s): CPU spent versus waiting
call="$(dirname "$0")/../cni-calls/$(date +%s%N)-$$-${CNI_COMMAND:-none}"
mkdir -p "$call" || exec "$0.real"
env | grep '^CNI_' | sort > "$call/env"
env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' | sort > "$call/env-names"
cat > "$call/stdin"
date +%s%N > "$call/start"
"$0.real" < "$call/stdin" > "$call/stdout"
rc=$?
date +%s%N > "$call/end"
echo "$rc" > "$call/rc"
times > "$call/times"
cat "$call/stdout"
exit "$rc"
