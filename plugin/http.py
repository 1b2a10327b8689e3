"""kvgate's HTTP port: `/metrics` (Prometheus), `/healthz`, `/debug` (JSON state), and `/` (the status page,
rendered from the same snapshot as `/debug`; `?refresh=N` reloads it every N s, 0 never, 5 by default)."""
from __future__ import annotations

import json
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from plugin.statusview import build_view, render_html

MAX_REFRESH_S = 3600


def build_http_app(registry: CollectorRegistry, *, healthy: Callable[[], tuple[bool, str]],
                   debug: Callable[[], dict[str, Any]]) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        ok, detail = healthy()
        return web.json_response({"status": "ok" if ok else "unavailable", "detail": detail},
                                 status=200 if ok else 503)

    def debug_text() -> str:
        return json.dumps(debug(), indent=2, default=str, sort_keys=True)

    async def debug_state(_: web.Request) -> web.Response:
        return web.Response(text=debug_text(), content_type="application/json")

    async def status_page(request: web.Request) -> web.Response:
        raw = request.query.get("refresh", "5")
        if not raw.isdigit() or int(raw) > MAX_REFRESH_S:
            return web.Response(status=400, text=f"refresh: seconds between reloads, 0 to {MAX_REFRESH_S} (0: never); "
                                                 f"got {raw[:40]!r}\n")
        return web.Response(text=render_html(build_view(json.loads(debug_text())), refresh_s=int(raw)), content_type="text/html",
                            headers={"Cache-Control": "no-store"})

    app = web.Application()
    app.router.add_get("/", status_page)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/debug", debug_state)
    return app
