"""Many grants questions, few kubelet calls: the broker asks kubelet in rounds.

kubelet answers PodResources behind one token bucket for every client on the node (100 QPS,
burst 10; rdma_netns.kubelet.ratelimit). A node starting a Job's pods asks about dozens of pods
at once, so one call per question would run into it. Instead, per kubelet socket:
- a question joins the *open* round, the one that has not asked kubelet yet;
- one round asks at a time; when it is done, the next open round goes (one of its askers leads);
- a round of one question asks Get (when this kubelet has Get), a larger one asks List once and
  answers every question in it from that listing.
Why no answer is stale: a round asks kubelet only after every question in it arrived, and kubelet
admits a pod (and allocates its devices) before its sandbox is created, so before the CNI's ADD
asks. A listing therefore always holds the pods whose questions it answers; nothing is cached
beyond the round. Calls wait for the device plugin's share of kubelet's bucket (the Client's
limiter) and retry kubelet's refusals inside the questions' deadlines (podresources.call).
"""

from __future__ import annotations

import threading
import time

from rdma_netns.kubelet import podresources
from rdma_netns.kubelet.podresources import PodGrant, PodResourcesUnavailable

Question = tuple[str, str, str]  # namespace, name, resource
MAX_SOCKETS = 8  # distinct kubelet sockets remembered (one in practice; requests name it)


class _Round:
    """Questions answered by one kubelet exchange."""

    def __init__(self) -> None:
        self.questions: list[Question] = []
        self.waiting = 0
        self.deadline = 0.0
        self.done = False
        self.answers: dict[Question, PodGrant] = {}
        self.listing: object | None = None
        self.error: Exception | None = None

    def answer(self, question: Question) -> PodGrant:
        if isinstance(self.error, PodResourcesUnavailable):  # a copy per asker: they raise it at once
            raise PodResourcesUnavailable(self.error.kind, self.error.message)
        if self.error is not None:
            raise RuntimeError(f"{type(self.error).__name__}: {self.error}")
        if question in self.answers:
            return self.answers[question]
        return podresources.grant_from_listing(self.listing, *question)


class _Socket:
    """One kubelet socket's rounds."""

    def __init__(self) -> None:
        self.open: _Round | None = None
        self.busy = False
        self.has_get: bool | None = None  # None: not known yet (asked again after kubelet restarts)


class GrantRounds:
    """The broker's Query: query(socket, namespace, name, resource, timeout) -> PodGrant."""

    def __init__(self, client: podresources.Client) -> None:
        self.client = client
        self._cond = threading.Condition()
        self._sockets: dict[str, _Socket] = {}
        self.rounds = 0  # kubelet exchanges made (for tests and logs)

    def __call__(self, socket: str, namespace: str, name: str, resource: str, timeout: float) -> PodGrant:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        path = podresources.socket_path(socket)
        deadline = time.monotonic() + timeout
        question = (namespace, name, resource)
        with self._cond:
            state = self._socket(path)
            joined = state.open = state.open or _Round()
            joined.questions.append(question)
            joined.waiting += 1
            joined.deadline = max(joined.deadline, deadline)
            try:
                lead = self._wait(state, joined, deadline)
            finally:
                joined.waiting -= 1
                if not joined.done and joined.waiting == 0 and state.open is joined:
                    state.open = None  # everyone gave up: nobody to answer
        if lead:
            self._ask(path, state, joined)
        return joined.answer(question)

    def _socket(self, path: str) -> _Socket:
        state = self._sockets.get(path)
        if state is None:
            if len(self._sockets) >= MAX_SOCKETS:
                for idle in [p for p, s in self._sockets.items() if not s.busy and s.open is None]:
                    del self._sockets[idle]
            state = self._sockets[path] = _Socket()
        return state

    def _wait(self, state: _Socket, joined: _Round, deadline: float) -> bool:
        """Until `joined` is answered (False) or this thread is to ask for it (True); the caller
        holds the condition."""
        while not joined.done:
            if not state.busy and state.open is joined:
                state.busy = True
                state.open = None  # closed: later questions form the next round
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PodResourcesUnavailable("timeout", "no answer in time: the kubelet calls of other pods' "
                                              "questions came first")
            self._cond.wait(remaining)
        return False

    def _ask(self, path: str, state: _Socket, joined: _Round) -> None:
        """One kubelet exchange for every question of `joined`."""
        deadline = joined.deadline
        try:
            only = joined.questions[0] if len(set(joined.questions)) == 1 else None
            if only is not None and state.has_get is not False:
                try:
                    joined.answers[only] = podresources.on_channel(
                        path, self.client, deadline,
                        lambda channel: podresources.get_pod(channel, path, *only, deadline, self.client))
                    state.has_get = True
                    return
                except podresources.GetUnsupported:
                    state.has_get = False
            joined.listing = podresources.on_channel(
                path, self.client, deadline, lambda channel: podresources.list_pods(channel, path, deadline, self.client))
        except PodResourcesUnavailable as exc:
            if exc.kind == "unreachable":
                state.has_get = None  # a restarted kubelet may be another version
            joined.error = exc
        except Exception as exc:  # a bug: every asker gets an error answer (the CNI reports 107)
            joined.error = exc
        finally:
            with self._cond:
                self.rounds += 1
                joined.done = True
                state.busy = False
                self._cond.notify_all()
