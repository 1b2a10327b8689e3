"""The request path's side of admission (routing.state.admission): after the pick, the picked pod or, when
it is full, the next of its ranked fallbacks with room; when none has room, the request waits in its
model's queue, then gets 429 with `Retry-After`. The admitted pod is released when the stream ends."""
from __future__ import annotations

import dataclasses

from plugin.request import ClientError
from routing.state.admission import Admission
from routing.registry import PodRegistry
from routing.router import Decision, Router


def rejected(admission: Admission) -> ClientError:
    return ClientError(429, f"every eligible pod runs its limit of {admission.max_running} requests; waited "
                       f"{admission.max_wait_s:g} s", type_="rate_limit_exceeded", code="admission_timeout",
                       retry_after=admission.retry_after_s)


async def admit(admission: Admission, router: Router, registry: PodRegistry, decision: Decision,
                model: str) -> tuple[Decision, str]:
    """(the decision, moved to the admitted pod if not the picked one; the admitted pod's name).
    Raises the 429 ClientError after the wait (the router's count is the caller's to release)."""
    d = decision
    candidates = [d.pod.name]
    pods = {}
    if d.rank is None and d.fallbacks:  # a rank-pinned request stays on its rank
        pods = {p.endpoint: p for p in registry.pods()}
        candidates += [pods[e].name for e in d.fallbacks if e in pods]
    got = await admission.admit(model, candidates)
    if got is None:
        raise rejected(admission)
    if got == d.pod.name:
        return d, got
    pod = next(p for p in pods.values() if p.name == got)
    router.served(d, pod.endpoint)
    rest = tuple(e for e in (d.pod.endpoint, *d.fallbacks) if e != pod.endpoint)
    return dataclasses.replace(d, pod=pod, fallbacks=rest), got
