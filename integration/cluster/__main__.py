"""scripts/cluster.sh: up | down | status | kubectl ARGS..."""

from __future__ import annotations

import os
import sys

from integration.cluster.cluster import Cluster, leftovers


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "down", "status", "kubectl"):
        print("usage: scripts/cluster.sh up | down | status | kubectl ARGS...", file=sys.stderr)
        return 2
    cluster = Cluster()
    command, rest = argv[0], argv[1:]
    if command == "up":
        cluster.up()
        print(cluster.status()[1])
        return 0
    if command == "down":
        cluster.down()
        left = leftovers(cluster.layout)
        if left:
            print("cluster.sh down: left behind: " + ", ".join(left), file=sys.stderr)
            return 1
        return 0
    if command == "status":
        if not cluster.layout.bin_file.exists():
            print(f"no cluster in {cluster.layout.root} (scripts/cluster.sh up)")
            return 3
        healthy, text = cluster.status()
        print(text)
        return 0 if healthy else 1
    os.execvp("nsenter", ["nsenter", f"--net={cluster.layout.netns_path}", "--", str(cluster.bin_dir / "kubectl"),
                          "--kubeconfig", str(cluster.layout.admin_kubeconfig), *rest])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
