"""Where each stored Responses API conversation lives: response id -> the pod that answered it.

vLLM keeps a response (with `store`, the default, and VLLM_ENABLE_RESPONSES_API_STORE=1) in the memory of the
engine that produced it; a later request naming it in `previous_response_id` works only there (any other
engine answers 404). kvgate learns the id from the answer it routed: the JSON body's top-level `id` or, for a
stream, the `response.created` event's `response.id` (both `resp_...`, the first such id in the body), read
from the first bytes of the response (at most READ_LIMIT of them) on the pod that served it. A request
continuing that conversation goes to that pod while it is ready; otherwise it is routed as any other (the
engine will answer 404, as vLLM would to a conversation it lost).

The map is bounded (least recently learned or used first out). Each gateway replica learns from the
responses it routed; the ids are not shared between replicas (a continuation routed by the other replica
falls back to its ordinary routing), see the README.
"""
from __future__ import annotations

import re
from collections import OrderedDict

READ_LIMIT = 8192  # bytes of a response searched for its id
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,200})"')


class ResponseStore:
    """Response id -> pod name, bounded to `limit` entries."""

    __slots__ = ("limit", "_pods")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the response id map needs room for at least one id")
        self.limit = limit
        self._pods: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, pod: str) -> None:
        pods = self._pods
        pods[response_id] = pod
        pods.move_to_end(response_id)
        if len(pods) > self.limit:
            pods.popitem(last=False)

    def pod_of(self, response_id: str) -> str | None:
        pod = self._pods.get(response_id)
        if pod is not None:
            self._pods.move_to_end(response_id)
        return pod

    def __len__(self) -> int:
        return len(self._pods)


class IdReader:
    """Finds a response's id in its first READ_LIMIT bytes, fed chunk by chunk."""

    __slots__ = ("_head", "done")

    def __init__(self) -> None:
        self._head = b""
        self.done = False

    def feed(self, chunk: bytes) -> str | None:
        """The id once found (then `done`), else None; gives up (`done`) past READ_LIMIT bytes."""
        if self.done or not chunk:
            return None
        head = self._head + chunk[:READ_LIMIT - len(self._head)]
        m = _ID.search(head)
        if m is not None:
            self.done = True
            self._head = b""
            return m.group(1).decode()
        if len(head) >= READ_LIMIT:
            self.done = True
            head = b""
        self._head = head
        return None
