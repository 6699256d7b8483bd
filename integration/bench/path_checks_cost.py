#!/usr/bin/env python3
"""What the rule for paths a config names (rdma_netns.util.trusted_paths) costs one CNI call.

A default ADD checks stateDir, podInfoDir, cdiSpecDir and eventsFifo at load, makes its state
folders (network, locks) and sends its event through the FIFO: this runs exactly those checks, on
this machine's real default paths, with the per-process memory cleared before each round (a CNI
call is a fresh process). Printed: lstat calls per round, the median round, and one lstat beside
it (the machine's speed).

    sudo .venv/bin/python -I integration/bench/path_checks_cost.py [--rounds 5000]
"""

from __future__ import annotations

import argparse
import posix
import statistics
import time

from rdma_netns.util import trusted_paths as t

PATHS = {"stateDir": "/var/lib/cni/rdma-netns", "podInfoDir": "/run/rdma-netns/pods",
         "cdiSpecDir": "/var/run/cdi", "eventsFifo": "/run/rdma-netns/cni-events"}


def one_call() -> None:
    t.forget()
    t.check_folder(PATHS["stateDir"])
    t.check_folder(PATHS["podInfoDir"])
    t.check_folder(PATHS["cdiSpecDir"])
    t.check_fifo(PATHS["eventsFifo"])
    for sub in ("", "/rdmanet", "/locks"):  # StateStore.prepare (a missing one: ADD would make it)
        t.check_folder(PATHS["stateDir"] + sub)
    t.check_fifo(PATHS["eventsFifo"])  # events.send


def median_us(fn, rounds: int) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5000)
    args = parser.parse_args()
    calls = [0]
    real = posix.lstat

    def counting(path):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(path)

    t.posix.lstat = counting
    one_call()
    t.posix.lstat = real
    print(f"lstat calls per ADD's checks: {calls[0]}")
    print(f"median of {args.rounds}: {median_us(one_call, args.rounds):.1f} us per call")
    print(f"one lstat: {median_us(lambda: posix.lstat('/var/lib/cni'), args.rounds):.2f} us")


if __name__ == "__main__":
    main()
