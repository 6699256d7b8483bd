"""Run another CNI plugin binary: stdin in, stdout and stderr out, with a time limit.

Built on os.posix_spawn and select.poll rather than subprocess, whose import (with its
signal, selectors and threading helpers) costs milliseconds on every pod event.
"""

from __future__ import annotations

import os
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
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.posix_spawn(path, [path], env, file_actions=[
            (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
    except BaseException:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    pending = memoryview(stdin)
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(in_w, select.POLLOUT)
    poller.register(out_r, select.POLLIN)
    poller.register(err_r, select.POLLIN)
    open_fds = {in_w, out_r, err_r}
    try:
        if not pending:
            poller.unregister(in_w)
            os.close(in_w)
            open_fds.discard(in_w)
        while out_r in open_fds or err_r in open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise TimedOut(path)
            for fd, events in poller.poll(left * 1000):
                if fd == in_w:
                    try:
                        pending = pending[os.write(in_w, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        poller.unregister(in_w)
                        os.close(in_w)
                        open_fds.discard(in_w)
                    continue
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    poller.unregister(fd)
                    os.close(fd)
                    open_fds.discard(fd)
        _, status = os.waitpid(pid, 0)
    finally:
        for fd in open_fds:
            os.close(fd)
    return Finished(os.waitstatus_to_exitcode(status), b"".join(chunks[out_r]), b"".join(chunks[err_r]))
