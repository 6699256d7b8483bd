#!/usr/bin/env bash
# Install what the Podman test (integration/runtime/test_podman.py) needs on Debian 12, idempotently:
#   podman 4.3 (with conmon and crun as dependencies; its CNI backend is built in, and Debian 12
#          has no netavark, so CNI is also its default backend there),
#   runc   (crun 1.8 refuses "hybrid" cgroup set-ups, v1 controllers plus a cgroup2 mount with
#          controllers, which some VMs have; the test uses runc when it is installed),
#   busybox-static (the test's container image is a tar of this one static binary, imported
#          with `podman import`: no image is pulled from any registry).
# containernetworking-plugins (host-local) and the .venv come from scripts/setup.sh.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "setup-podman.sh: run as root" >&2
  exit 2
fi
missing=()
for pkg in podman conmon crun runc busybox-static containernetworking-plugins; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup-podman.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup-podman.sh: ready ($(podman --version), runc $(runc --version | sed -n 's/^runc version //p'))"
