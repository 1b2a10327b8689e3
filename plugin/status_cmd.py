"""`kvgate status`: the status page's view in the terminal, for one replica (`--url`, repeatable) or every
replica of a Service (`--service NAME[:PORT]`: each address the name resolves to, e.g. the A records of a
headless Service), read from each replica's `/debug` over HTTP."""
from __future__ import annotations

import argparse
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

from plugin.statusview import StatusView, build_view, render_text

DEFAULT_PORT = 8080  # KVGATE_HTTP_PORT's default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", default=[],
                   help="a replica's HTTP base URL, e.g. http://kvgate-0:8080 (repeatable)")
    p.add_argument("--service", action="append", default=[], metavar="NAME[:PORT]",
                   help=f"every address NAME resolves to, on PORT (default {DEFAULT_PORT}): a headless Service's "
                        "replicas (repeatable)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per replica (default 3)")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgate status")
    add_arguments(p)
    return p.parse_args(argv)


def service_urls(service: str) -> list[str]:
    """`http://ADDRESS:PORT` for each distinct address `NAME[:PORT]` resolves to, in sorted order."""
    name, port = service, DEFAULT_PORT
    if service.count(":") == 1:
        name, _, port_text = service.partition(":")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536 or not name:
            raise ValueError(f"--service {service!r}: expected NAME or NAME:PORT (a port from 1 to 65535)")
        port = int(port_text)
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    addresses = sorted({str(info[4][0]) for info in infos})
    return [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses]


def fetch(url: str, timeout: float) -> StatusView | str:
    """The replica's view, or why it could not be read."""
    try:
        r = httpx.get(url.rstrip("/") + "/debug", timeout=timeout)
        r.raise_for_status()
        return build_view(r.json())
    except (httpx.HTTPError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def main(args: argparse.Namespace) -> int:
    urls = list(args.url)
    for service in args.service:
        try:
            found = service_urls(service)
        except (ValueError, OSError) as e:
            print(f"kvgate status: cannot resolve {service!r}: {e}", file=sys.stderr)
            return 2
        urls += found
    if not urls:
        print("kvgate status: name a replica (--url URL) or a Service (--service NAME[:PORT])", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        views = list(pool.map(lambda u: fetch(u, args.timeout), urls))
    print(render_text(zip(urls, views)))
    return 1 if any(isinstance(v, str) for v in views) else 0
