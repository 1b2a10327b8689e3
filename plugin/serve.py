"""`kvgate serve`: the ext_proc server, configured by KVGATE_* environment variables."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

from plugin.config import ConfigError, Settings

log = logging.getLogger("kvgate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "Every setting is an environment variable; see the README's table."


async def _serve(settings: Settings) -> int:
    from plugin.app import App  # heavy imports only once the configuration is known to be good
    from routing.errors import DiscoveryError

    try:
        app = App(settings)
    except (DiscoveryError, ValueError) as e:  # e.g. a malformed KVGATE_PODS; the message names it
        print(f"kvgate serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    try:
        await app.start()
    except Exception as e:
        log.error("kvgate could not start: %s", e)
        await app.stop(0)
        return 1
    settle_heap()
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    await signals.get()
    log.info("kvgate stopping: draining (a second signal stops at once)")
    drain = asyncio.create_task(app.drain(settings.drain_delay_s, settings.drain_timeout_s))
    second = asyncio.create_task(signals.get())
    await asyncio.wait((drain, second), return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.info("kvgate stopping now")
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
        await app.stop(0)
    second.cancel()
    return 0


def settle_heap() -> int:
    """Move every object built at start-up (about 100k, mostly the tokenizer library's modules) out of
    the garbage collector's reach: they live as long as the process, and each full collection over
    them stopped every request for about 50 ms. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def main(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_env(os.environ)
    except ConfigError as e:
        print(f"kvgate serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape and tokenize call is noise
    return asyncio.run(_serve(settings))
