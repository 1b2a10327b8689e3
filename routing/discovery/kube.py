"""Kubernetes API access for discovery: the API server's address and credentials, and one
list+watch of a collection (resourceVersion, bookmarks, 410 Gone answered by listing again)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import aiohttp

from routing.errors import DiscoveryError

log = logging.getLogger(__name__)

_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_MAX_LINE = 16 << 20


@dataclass(frozen=True)
class ApiConfig:
    api_url: str = ""  # empty: in-cluster, https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_file: str = f"{_SA_DIR}/token"
    ca_file: str = f"{_SA_DIR}/ca.crt"
    namespace_file: str = f"{_SA_DIR}/namespace"
    watch_timeout_s: int = 300
    request_timeout_s: float = 10.0
    backoff_min_s: float = 0.5
    backoff_max_s: float = 10.0


class Gone(Exception):
    """The resourceVersion is too old (HTTP 410): list again."""


class Api:
    """The API server: base URL, bearer token (re-read per request: bound tokens rotate), CA."""

    def __init__(self, config: ApiConfig, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.config = config
        url = config.api_url
        if not url:
            host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise DiscoveryError("Kubernetes discovery: KVGATE_K8S_API_URL is empty and KUBERNETES_SERVICE_HOST "
                                     "is unset (not in a cluster?)")
            url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.url = url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    def namespace(self, configured: str) -> str:
        """`configured`, else the service account's namespace; empty if neither."""
        if configured or not os.path.exists(self.config.namespace_file):
            return configured
        with open(self.config.namespace_file, encoding="utf-8") as f:
            return f.read().strip()

    def headers(self) -> dict[str, str]:
        try:
            with open(self.config.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError:
            return {}
        return {"Authorization": f"Bearer {token}"} if token else {}

    def open(self) -> aiohttp.ClientSession:
        if self.session is None:
            ctx = None
            if self.url.startswith("https://") and os.path.exists(self.config.ca_file):
                ctx = ssl.create_default_context(cafile=self.config.ca_file)
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx or True))
        return self.session

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


class ListWatch:
    """One collection (`path` with `params`, e.g. a labelSelector): `list()` hands every item to
    `on_list(items)`; `run()` then watches from the list's resourceVersion, handing each change to
    `on_event(type, object)`, watching again when the server ends a watch (timeoutSeconds), and
    listing again when the resourceVersion expired (410, as a status or an ERROR event) or the watch
    failed. Bookmarks only move the resourceVersion on."""

    def __init__(self, api: Api, path: str, params: Mapping[str, str], *, what: str,
                 on_list: Callable[[list[dict]], Any], on_event: Callable[[str, dict], Any],
                 on_error: Callable[[], None] | None = None) -> None:
        self.api, self.path, self.params, self.what = api, path, dict(params), what
        self.on_list, self.on_event, self.on_error = on_list, on_event, on_error
        self.resource_version = ""
        self.lists = 0
        self.watches = 0

    async def list(self) -> None:
        cfg = self.api.config
        async with self.api.open().get(self.api.url + self.path, params=self.params, headers=self.api.headers(),
                                       timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s)) as resp:
            if resp.status != 200:
                raise DiscoveryError(f"{self.what}: list answered HTTP {resp.status}: {(await resp.text())[:200]}")
            body = await resp.json(content_type=None)
        await _maybe_await(self.on_list(list(body.get("items") or [])))
        self.resource_version = (body.get("metadata") or {}).get("resourceVersion", "")
        self.lists += 1

    async def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type") or ""
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise DiscoveryError(f"{self.what}: watch error {obj.get('code')}: {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = rv
        if kind == "BOOKMARK":
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("%s: ignoring watch event of type %r", self.what, kind)
            return
        await _maybe_await(self.on_event(kind, obj))

    async def watch(self) -> None:
        cfg = self.api.config
        params = {**self.params, "watch": "1", "allowWatchBookmarks": "true",
                  "resourceVersion": self.resource_version, "timeoutSeconds": str(cfg.watch_timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.request_timeout_s,
                                        sock_read=cfg.watch_timeout_s + 30)
        self.watches += 1
        async with self.api.open().get(self.api.url + self.path, params=params, headers=self.api.headers(),
                                       timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status != 200:
                raise DiscoveryError(f"{self.what}: watch answered HTTP {resp.status}: {(await resp.text())[:200]}")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        await self._apply(json.loads(line))
                if len(buf) > _MAX_LINE:
                    raise DiscoveryError(f"{self.what}: watch line longer than {_MAX_LINE} bytes")

    async def run(self) -> None:
        """Watch until cancelled (after a first `list()`)."""
        cfg = self.api.config
        backoff = cfg.backoff_min_s
        relist = False
        loop = asyncio.get_running_loop()
        while True:
            try:
                if relist:
                    await self.list()
                    relist = False
                started = loop.time()
                await self.watch()  # ends when the server closes the watch: watch again from where it was
                if loop.time() - started < 1.0:  # a server ending watches at once: no busy loop
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, cfg.backoff_max_s)
                else:
                    backoff = cfg.backoff_min_s
            except asyncio.CancelledError:
                raise
            except Gone:
                log.info("%s: resourceVersion %s expired, listing again", self.what, self.resource_version)
                relist = True
            except Exception as e:
                if self.on_error is not None:
                    self.on_error()
                log.warning("%s: watch failed (%s: %s); retrying in %.1fs", self.what, type(e).__name__, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, cfg.backoff_max_s)
                relist = True


async def _maybe_await(value: Any) -> None:
    if isinstance(value, Awaitable):
        await value
