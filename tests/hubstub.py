"""A stand-in for the Hugging Face hub's file-resolve URLs, on loopback, for tests (no hub is reachable).

It answers what `huggingface_hub.hf_hub_download` asks, as the hub does:
- `HEAD|GET /{repo}/resolve/{revision}/{filename}`:
  - a small file: 200 with `ETag` (its git blob sha1), `X-Repo-Commit` and `Content-Length` (GET: the bytes);
  - a large ("LFS") file: 302 to a CDN host with `Location`, `X-Linked-Etag` (sha256), `X-Linked-Size`
    and `X-Repo-Commit`; the CDN (a second listener on 127.0.0.2) serves `/cdn/{sha256}` without auth;
  - a file the repository lacks: 404 with `X-Error-Code: EntryNotFound` and `X-Repo-Commit`;
  - an unknown repository or revision: 404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound`;
  - a gated repository without its token (`Authorization: Bearer ...`): 403 with `X-Error-Code: GatedRepo`.
Every request is recorded (method, host, path, whether it carried a token). Runs in its own thread.
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from helpers import serve_app

CDN_HOST = "127.0.0.2"  # loopback too, but another host: huggingface_hub treats it as a CDN


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None  # gated: this token is required

    @classmethod
    def from_dir(cls, directory: Path, **kw) -> "Repo":
        return cls({p.name: p.read_bytes() for p in Path(directory).iterdir() if p.suffix in (".json", ".jinja")}, **kw)


@dataclass
class Seen:
    method: str
    host: str
    path: str
    authorized: bool


@dataclass
class HubStub:
    repos: dict[str, Repo]
    lfs_bytes: int = 64 * 1024  # files at least this large go through the CDN redirect
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._cdn: dict[str, bytes] = {}

    def __enter__(self) -> "HubStub":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def gets(self, host: str | None = None) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and (host is None or s.host == host)]

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/cdn/{sha}", self._cdn_file)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{filename}", self._resolve)
        self._runner, port = await serve_app(app, access_log=None)
        await web.TCPSite(self._runner, CDN_HOST, port).start()  # the CDN: another host name, the same port
        self.url = f"http://127.0.0.1:{port}"
        self._cdn_url = f"http://{CDN_HOST}:{port}"

    def _record(self, request: web.Request) -> None:
        self.seen.append(Seen(request.method, request.host.rsplit(":", 1)[0], request.path,
                              "Authorization" in request.headers))

    async def _resolve(self, request: web.Request) -> web.Response:
        self._record(request)
        m = request.match_info
        repo = self.repos.get(f"{m['org']}/{m['name']}")
        if repo is None:
            return web.Response(status=404, headers={"X-Error-Code": "RepoNotFound"}, text="Repository not found")
        if repo.token is not None and request.headers.get("Authorization") != f"Bearer {repo.token}":
            return web.Response(status=403, headers={"X-Error-Code": "GatedRepo"}, text="Access to this repo is gated")
        if m["revision"] not in ("main", repo.commit):
            return web.Response(status=404, headers={"X-Error-Code": "RevisionNotFound"}, text="Invalid rev id")
        data = repo.files.get(m["filename"])
        if data is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit},
                                text="Entry not found")
        if len(data) >= self.lfs_bytes:
            sha = hashlib.sha256(data).hexdigest()
            self._cdn[sha] = data
            return web.Response(status=302, headers={
                "Location": f"{self._cdn_url}/cdn/{sha}", "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                "X-Repo-Commit": repo.commit, "ETag": f'"{_git_sha1(data)}"'})
        headers = {"ETag": f'"{_git_sha1(data)}"', "X-Repo-Commit": repo.commit}
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(len(data))})
        return web.Response(status=200, body=data, headers=headers)

    async def _cdn_file(self, request: web.Request) -> web.Response:
        self._record(request)
        data = self._cdn.get(request.match_info["sha"])
        if data is None:
            return web.Response(status=404)
        if request.method == "HEAD":
            return web.Response(status=200, headers={"Content-Length": str(len(data))})
        return web.Response(status=200, body=data)


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
