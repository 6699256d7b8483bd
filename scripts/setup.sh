#!/usr/bin/env bash
# Install everything rdma-netns needs on a Debian 12 machine, idempotently: Debian's CNI
# reference plugins (host-local IPAM, and the Go plugins the benchmark compares against),
# iproute2 and ping for the demo, Podman (with runc and busybox-static: the real-runtime test),
# strace and GNU time for the benchmarks, mmdebstrap and patchelf for scripts/build-image.sh,
# Prometheus and promtool (the metrics tests scrape the device plugin with a real server), Graphviz
# (the docs test renders docs/img/node.dot),
# Debian 13's containerd 1.7 beside Debian 12's 1.6 (integration/cri/fetch-containerd.sh), and a
# virtual environment (.venv) with rdma-netns installed the way a node gets it (a real install,
# byte-compiled; not an editable one).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "setup.sh: run as root (it installs Debian packages; the demo and tests create namespaces)" >&2
  exit 2
fi

missing=()
for pkg in containernetworking-plugins iproute2 iputils-ping podman conmon crun runc busybox-static containerd strace time \
           mmdebstrap patchelf prometheus graphviz python3.11 python3-venv; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Debian's own Python 3.11 (the interpreter the release image ships, and the one python3-pyverbs
# is built for), not whichever python3 comes first on PATH: a self-built one with a 23 MB shared
# libpython took 7-10 s to start in the real-kernel guests (read over 9p on every start) against
# Debian's 1.7 s. A venv made from another interpreter is made again.
PYTHON=${PYTHON:-/usr/bin/python3.11}
if [ -x .venv/bin/python ] && [ "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" != "$PYTHON" ]; then
  echo "setup.sh: .venv was made from another Python; making it again from $PYTHON"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check '.[test]'
# Always replace the project itself, so the venv runs exactly this checkout (setuptools' build/
# cache would otherwise ship modules this checkout no longer has).
rm -rf build
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall .
# A test install: its plugin honours the test-only environment variables the suites set
# (cni/rdma_netns/testhooks.py); install.sh and the release image never write this marker.
.venv/bin/python -I -c 'from rdma_netns import testhooks; open(testhooks.marker_path(), "w").write("a test build\n")'
# containerd 1.7 (Debian 13's, read through a private apt state) beside Debian 12's 1.6: the CRI and
# deploy suites run on both (1.7 for CDI); the machine's own containerd stays 1.6.
integration/cri/fetch-containerd.sh >/dev/null
echo "setup.sh: ready ($(.venv/bin/rdma-netns --version))"
