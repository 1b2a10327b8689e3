"""A stand-in Kubernetes API server for discovery tests: pods and InferencePools in one namespace,
served the way the API server serves them: list (with the collection's resourceVersion) and
watch from a resourceVersion (history replayed, then live events; label and field selectors,
an object leaving a selector seen as DELETED), bookmarks, watches ended by timeoutSeconds, and
410 Gone for a resourceVersion older than the compacted history (as an HTTP status when a watch
starts, as an ERROR event on a watch already open)."""
from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field

from aiohttp import web

from helpers import serve_app

POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
PODS = "/api/v1/namespaces/{ns}/pods"


def _matches(obj: dict, query) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        key, _, value = term.partition("=")
        if key == "metadata.name" and obj["metadata"]["name"] != value:
            return False
    return True


@dataclass
class _Watch:
    resource: str
    query: dict
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class KubeAPI:
    def __init__(self, namespace: str) -> None:
        self.ns = namespace
        self.rv = 100
        self.compacted = 0  # watches from a resourceVersion below this get 410
        self.objects: dict[str, dict[str, dict]] = {"pods": {}, "inferencepools": {}}
        self.history: list[tuple[int, str, str, dict, dict | None]] = []  # rv, resource, type, obj, previous
        self.watches: list[_Watch] = []
        self.requests: list[tuple[str, dict]] = []  # (resource, query) of every list and watch
        self.gone = 0  # watches refused with HTTP 410

    # -- changing the world ---------------------------------------------------------------------
    def put(self, resource: str, obj: dict, *, unseen: bool = False) -> dict:
        """Create or replace `obj`; `unseen`: open watches miss the event (they lag behind)."""
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        obj["metadata"].setdefault("namespace", self.ns)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        previous = self.objects[resource].get(obj["metadata"]["name"])
        self.objects[resource][obj["metadata"]["name"]] = obj
        self._record(resource, "MODIFIED" if previous else "ADDED", obj, previous, unseen)
        return obj

    def delete(self, resource: str, name: str) -> None:
        self.rv += 1
        obj = copy.deepcopy(self.objects[resource].pop(name))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record(resource, "DELETED", obj, obj)

    def _record(self, resource: str, kind: str, obj: dict, previous: dict | None, unseen: bool = False) -> None:
        self.history.append((self.rv, resource, kind, obj, previous))
        for w in self.watches if not unseen else ():
            if w.resource == resource:
                event = self._event_for(w.query, kind, obj, previous)
                if event is not None:
                    w.queue.put_nowait(event)

    @staticmethod
    def _event_for(query, kind: str, obj: dict, previous: dict | None) -> dict | None:
        now = kind != "DELETED" and _matches(obj, query)
        before = previous is not None and _matches(previous, query)
        if now:
            return {"type": "MODIFIED" if before and kind != "ADDED" else "ADDED", "object": obj}
        if before:  # deleted, or no longer selected
            return {"type": "DELETED", "object": obj}
        return None

    def bookmark(self) -> None:
        for w in self.watches:
            if w.query.get("allowWatchBookmarks") == "true":
                w.queue.put_nowait({"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {
                    "resourceVersion": str(self.rv)}}})

    def compact(self) -> None:
        """Forget the history so far: older resourceVersions are gone."""
        self.compacted = self.rv
        self.history.clear()

    def expire_watches(self) -> None:
        """Tell every open watch its resourceVersion is too old (an ERROR event with code 410)."""
        for w in self.watches:
            w.queue.put_nowait({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                            "message": "too old resource version"}})

    def end_watches(self) -> None:
        for w in self.watches:
            w.queue.put_nowait(None)

    def count(self, resource: str, watch: bool) -> int:
        return sum(1 for r, q in self.requests if r == resource and (q.get("watch") == "1") == watch)

    # -- HTTP -----------------------------------------------------------------------------------
    async def _handle(self, request: web.Request, resource: str) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((resource, query))
        if query.get("watch") != "1":
            items = [o for o in self.objects[resource].values() if _matches(o, query)]
            return web.json_response({"kind": "List", "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        since = int(query.get("resourceVersion") or 0)
        if since < self.compacted:
            self.gone += 1
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"}, status=410)
        w = _Watch(resource, query)
        for rv, res, kind, obj, previous in self.history:  # what happened since the client's version
            if rv > since and res == resource:
                event = self._event_for(query, kind, obj, previous)
                if event is not None:
                    w.queue.put_nowait(event)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        self.watches.append(w)
        timeout = float(query.get("timeoutSeconds") or 3600)
        try:
            async with asyncio.timeout(timeout):
                while (event := await w.queue.get()) is not None:
                    await resp.write((json.dumps(event) + "\n").encode())
                    if event["type"] == "ERROR":
                        break
        except TimeoutError:
            pass
        finally:
            self.watches.remove(w)
        return resp

    async def start(self) -> str:
        app = web.Application()
        async def pods(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, "pods")

        async def pools(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, "inferencepools")

        app.router.add_get(PODS.format(ns=self.ns), pods)
        app.router.add_get(POOLS.format(ns=self.ns), pools)
        self._runner, port = await serve_app(app, shutdown_timeout=0.1)
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.end_watches()
        await self._runner.cleanup()


def pool(name: str, labels: dict, ports: list[int]) -> dict:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "kvgate", "port": {"number": 50051}}}}


def pod(name: str, ip: str, labels: dict, *, ready: bool = True, phase: str = "Running") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "status": {"phase": phase, "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
