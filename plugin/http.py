"""kvgate's HTTP port: `/metrics` (Prometheus), `/healthz`, and `/debug` (JSON state)."""
from __future__ import annotations

import json
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def build_http_app(registry: CollectorRegistry, *, healthy: Callable[[], tuple[bool, str]],
                   debug: Callable[[], dict[str, Any]]) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        ok, detail = healthy()
        return web.json_response({"status": "ok" if ok else "unavailable", "detail": detail},
                                 status=200 if ok else 503)

    async def debug_state(_: web.Request) -> web.Response:
        return web.Response(text=json.dumps(debug(), indent=2, default=str, sort_keys=True),
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/debug", debug_state)
    return app
