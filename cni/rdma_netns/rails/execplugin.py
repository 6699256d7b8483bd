"""Run another CNI plugin binary: stdin in, stdout and stderr out, with a time limit.

Built on posix.posix_spawn and select.poll rather than subprocess, whose import (with its
signal, selectors and threading helpers) costs milliseconds on every pod event. run_many starts
several at once (a pod's rails' IPAM delegates) and waits for all in one poll loop.
"""

from __future__ import annotations

import posix
import select
import time


class Finished:
    __slots__ = ("returncode", "stdout", "stderr")

    def __init__(self, returncode: int, stdout: bytes, stderr: bytes) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class TimedOut(Exception):
    """The plugin did not finish in time; it has been killed."""


def run(path: str, stdin: bytes, env: dict[str, str], timeout: float) -> Finished:
    """Run `path` with no arguments (CNI plugins take everything from env and stdin)."""
    (outcome,) = run_many([(path, stdin, env)], timeout)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


class _Child:
    """One spawned plugin: its pid, pipes and what it has written so far."""

    __slots__ = ("path", "pid", "stdin", "pending", "out", "err", "chunks", "status")

    def __init__(self, path: str, stdin: bytes, env: dict[str, str]) -> None:
        in_r, in_w = posix.pipe2(posix.O_CLOEXEC)
        out_r, out_w = posix.pipe2(posix.O_CLOEXEC)
        err_r, err_w = posix.pipe2(posix.O_CLOEXEC)
        try:
            dup2 = posix.POSIX_SPAWN_DUP2
            self.pid = posix.posix_spawn(path, [path], env, file_actions=[
                (dup2, in_r, 0), (dup2, out_w, 1), (dup2, err_w, 2)])
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                posix.close(fd)
            raise
        for fd in (in_r, out_w, err_w):
            posix.close(fd)
        self.path, self.stdin, self.out, self.err = path, in_w, out_r, err_r
        self.pending = memoryview(stdin)
        self.chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        self.status: int | None = None


def run_many(calls: list[tuple[str, bytes, dict[str, str]]], timeout: float,
             spawned_hook=None) -> list[Finished | BaseException]:
    """Run several plugins at once (one poll loop, no threads), each with the same time limit
    from now. One outcome per call, in order: its Finished, or the exception that ended it
    (TimedOut when it was killed at the deadline, OSError when it could not be started).
    `spawned_hook` is called once all are running with their whole input (the fault suite's crash
    point: killed then, the plugins finish on their own)."""
    deadline = time.monotonic() + timeout
    outcomes: list[Finished | BaseException | None] = [None] * len(calls)
    children: dict[int, tuple[int, _Child]] = {}  # fd -> (call number, child)
    poller = select.poll()
    spawned: list[tuple[int, _Child]] = []
    for n, (path, stdin, env) in enumerate(calls):
        try:
            child = _Child(path, stdin, env)
        except OSError as exc:
            outcomes[n] = exc
            continue
        spawned.append((n, child))
        for fd in (child.out, child.err):
            children[fd] = (n, child)
            poller.register(fd, select.POLLIN)
        if child.pending:
            children[child.stdin] = (n, child)
            poller.register(child.stdin, select.POLLOUT)
        else:
            posix.close(child.stdin)
    writing = sum(1 for _n, child in spawned if child.stdin in children)
    if writing == 0 and spawned_hook is not None:
        spawned_hook()
    try:
        while children:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _events in poller.poll(left * 1000):
                n, child = children[fd]
                if fd == child.stdin:
                    try:
                        child.pending = child.pending[posix.write(fd, child.pending[:65536]):]
                    except BrokenPipeError:
                        child.pending = child.pending[:0]
                    if not child.pending:
                        _close(poller, children, fd)
                        writing -= 1
                        if writing == 0 and spawned_hook is not None:
                            spawned_hook()
                    continue
                data = posix.read(fd, 65536)
                if data:
                    child.chunks[fd].append(data)
                else:
                    _close(poller, children, fd)
    finally:
        for fd in list(children):  # past the deadline (or an error here): what is still open
            _close(poller, children, fd)
        for n, child in spawned:
            if outcomes[n] is not None:
                continue
            done, status = posix.waitpid(child.pid, posix.WNOHANG)
            if done == 0 and time.monotonic() >= deadline:
                posix.kill(child.pid, 9)
                posix.waitpid(child.pid, 0)
                outcomes[n] = TimedOut(child.path)
                continue
            if done == 0:
                _, status = posix.waitpid(child.pid, 0)
            outcomes[n] = Finished(posix.waitstatus_to_exitcode(status), b"".join(child.chunks[child.out]),
                                   b"".join(child.chunks[child.err]))
    return outcomes  # type: ignore[return-value]


def _close(poller: select.poll, children: dict, fd: int) -> None:
    poller.unregister(fd)
    posix.close(fd)
    del children[fd]
