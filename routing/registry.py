"""PodRegistry: the current set of pods from one discovery source, with change listeners."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable

from routing.pods import Pod

log = logging.getLogger(__name__)

PodListener = Callable[[list[Pod], list[Pod]], None]


def _identity(pod: Pod) -> Pod:
    # Readiness flips do not change what a listener subscribes to, so they are not "changes".
    return dataclasses.replace(pod, ready=True)


class PodRegistry:
    """Holds the pods discovery reported last; a discovery source calls `replace`.

    Listeners get `(added, removed)`: a pod whose address, ports, model or adapters
    changed appears in both (old one removed, new one added). A change of `ready`
    alone notifies nobody.
    """

    def __init__(self, pods: Iterable[Pod] = ()) -> None:
        self._pods: dict[str, Pod] = {}
        self._by_model: dict[str, tuple[tuple[Pod, ...], tuple[Pod, ...]]] = {}  # see candidates()
        self._listeners: list[PodListener] = []
        self.replace(pods)

    def add_listener(self, fn: PodListener) -> None:
        self._listeners.append(fn)

    def replace(self, pods: Iterable[Pod]) -> tuple[list[Pod], list[Pod]]:
        """Make `pods` the current set; returns and announces `(added, removed)`."""
        new: dict[str, Pod] = {}
        for pod in pods:
            if pod.name in new:
                raise ValueError(f"duplicate pod name {pod.name!r}")
            new[pod.name] = pod
        added: list[Pod] = []
        removed: list[Pod] = []
        for name, old in self._pods.items():
            cur = new.get(name)
            if cur is None:
                removed.append(old)
            elif _identity(cur) != _identity(old):
                removed.append(old)
                added.append(cur)
        added.extend(p for n, p in new.items() if n not in self._pods)
        self._pods = new
        self._by_model = {}
        if added or removed:
            log.info("pods changed: +%s -%s", [p.name for p in added], [p.name for p in removed])
            for fn in list(self._listeners):
                try:
                    fn(added, removed)
                except Exception:  # one faulty listener must not stop the others
                    log.exception("pod listener %r failed", fn)
        return added, removed

    def get(self, name: str) -> Pod | None:
        return self._pods.get(name)

    def pods(self) -> list[Pod]:
        return list(self._pods.values())

    def serving(self, model: str) -> list[Pod]:
        """Every pod serving `model` (base model or adapter), ready or not."""
        return [p for p in self._pods.values() if p.serves(model)]

    def candidates(self, model: str) -> tuple[tuple[Pod, ...], tuple[Pod, ...]]:
        """(every pod serving `model`, those of them ready), kept until the pods change: asked for on
        every routed request."""
        found = self._by_model.get(model)
        if found is None:
            serving = tuple(p for p in self._pods.values() if p.serves(model))
            if len(self._by_model) >= 1024:  # model names come from requests: keep the memo bounded
                self._by_model.clear()
            found = self._by_model[model] = (serving, tuple(p for p in serving if p.ready))
        return found

    def ready_pods(self, model: str) -> list[Pod]:
        return [p for p in self._pods.values() if p.ready and p.serves(model)]

    def models(self) -> set[str]:
        """Base models and adapter names served by at least one pod."""
        out: set[str] = set()
        for p in self._pods.values():
            out.add(p.model)
            out.update(p.lora)
        return out
