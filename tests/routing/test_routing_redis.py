"""Running counts through a real redis-server on loopback: two gateways agree, a dead gateway's
counts expire, Redis killed and restarted under load loses no pick and reconverges, AUTH."""
from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time

import pytest

from devkit.stack import StackError, wait_for_port
from routing.state.counts import LocalCounts, RedisCounts, build_counts, redact_url
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.scoring import RouteRequest
from helpers import RedisServer, free_port, make_tls_certs, wait_until_async

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

# Short heartbeats and back-offs; the key TTL and the op timeout leave room for a loaded machine (a
# gateway paused past its TTL vanishes from the others' view; an op past its timeout backs off).
FAST = dict(ttl_s=5.0, heartbeat_s=0.2, read_max_age_s=0.0, op_timeout_s=2.0, backoff_min_s=0.05,
            backoff_max_s=0.3)


def pods(n=4):
    return [Pod(f"p{i}", f"10.0.0.{i}", 8000, "m") for i in range(n)]


async def gateway(url: str, gid: str, seed: int = 0, pod_list=None, **options) -> tuple[Router, RedisCounts]:
    counts = RedisCounts(url, gid, **{**FAST, **options})
    router = Router(PodRegistry(pod_list or pods()), default_strategy="least-request", counts=counts, seed=seed)
    await router.start()
    return router, counts


async def converged(a: RedisCounts, b: RedisCounts) -> bool:
    """Both views read fresh from Redis (after this call began: not a cached or backed-off view) and equal."""
    started = time.monotonic()
    await a.refresh()
    await b.refresh()
    fresh = all(c.others_read_at is not None and c.others_read_at >= started for c in (a, b))
    return fresh and a.totals() == b.totals()


async def release_all(*gateways: tuple[Router, RedisCounts, list]) -> bool:
    """Each gateway releases what it held and flushes; true once both views agree on nothing running."""
    for router, _, held in gateways:
        for d in held:
            await router.release(d)
    for _, counts, _ in gateways:
        await counts.flush()
    (_, a, _), (_, b, _) = gateways
    return await converged(a, b) and a.totals() == {}


def test_url_handling():
    assert redact_url("rediss://user:pw@redis.example:6380/1") == "rediss://user:***@redis.example:6380/1"
    assert redact_url("redis://:pw@[::1]:6379") == "redis://:***@[::1]:6379"
    assert redact_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"
    assert isinstance(build_counts(""), LocalCounts)
    assert isinstance(build_counts("rediss://:pw@127.0.0.1:6380/0", "g"), RedisCounts)
    with pytest.raises(ValueError, match="KVGATE_REDIS_URL") as e:
        RedisCounts("http://:topsecret@127.0.0.1:1")
    assert "topsecret" not in str(e.value)


async def test_two_gateways_share_counts(redis_server):
    ra, ca = await gateway(redis_server.url, "gw-a", 1)
    rb, cb = await gateway(redis_server.url, "gw-b", 2)
    try:
        held_a = [await ra.pick(RouteRequest("m")) for _ in range(6)]
        assert await ca.flush()
        held_b = [await rb.pick(RouteRequest("m")) for _ in range(6)]  # B sees A's 6 and fills the rest
        assert await cb.flush()
        assert await converged(ca, cb)
        assert ca.totals() == cb.totals() == {f"p{i}": 3 for i in range(4)}
        assert cb.snapshot()["other_gateways"] == 1
        assert await release_all((ra, ca, held_a), (rb, cb, held_b))
    finally:
        await ra.close()
        await rb.close()


async def test_two_gateways_share_counts_per_data_parallel_rank(redis_server):
    fleet = [Pod("a", "10.0.0.1", 8000, "m", kv_events=KVEventsEndpoint(dp_size=2)), Pod("b", "10.0.0.2", 8000, "m")]
    ra, ca = await gateway(redis_server.url, "gw-a", 1, fleet)
    rb, cb = await gateway(redis_server.url, "gw-b", 2, fleet)
    try:
        held_a = [await ra.pick(RouteRequest("m")) for _ in range(4)]
        assert await ca.flush()
        held_b = [await rb.pick(RouteRequest("m")) for _ in range(2)]  # B sees A's picks per rank
        assert await cb.flush()
        assert await converged(ca, cb)
        # three targets: rank 0 and rank 1 of a (hash fields `a#0`, `a#1`) and b, 2 each
        assert ca.totals() == cb.totals() == {"a#0": 2, "a#1": 2, "b": 2}
        assert sorted((d.pod.name, d.rank) for d in held_a + held_b) == [
            ("a", 0), ("a", 0), ("a", 1), ("a", 1), ("b", None), ("b", None)]
        assert await release_all((ra, ca, held_a), (rb, cb, held_b))
    finally:
        await ra.close()
        await rb.close()


async def test_concurrent_picks_on_two_gateways_stay_balanced(redis_server):
    ra, ca = await gateway(redis_server.url, "gw-a", 1)
    rb, cb = await gateway(redis_server.url, "gw-b", 2)
    try:
        async def burst(r):
            out = []
            for _ in range(20):
                out.append(await r.pick(RouteRequest("m")))
                await asyncio.sleep(0.005)
            return out
        da, db = await asyncio.gather(burst(ra), burst(rb))
        await ca.flush(), await cb.flush()
        assert await converged(ca, cb)
        totals = ca.totals()
        assert sum(totals.values()) == 40
        assert max(totals.values()) - min(totals.values()) <= 4, totals
    finally:
        await ra.close()
        await rb.close()


async def test_dead_gateway_counts_expire(redis_server):
    ra, ca = await gateway(redis_server.url, "gw-dead", ttl_s=1.0)
    rb, cb = await gateway(redis_server.url, "gw-alive")
    try:
        for _ in range(5):
            await ra.pick(RouteRequest("m"))
        await ca.flush()
        await cb.refresh()
        assert sum(cb.totals().values()) == 5
        await ca.close(unregister=False)  # stops heartbeating, like a crashed gateway

        async def gone():
            await cb.refresh()
            return cb.totals() == {}
        await wait_until_async(gone, timeout=10, interval=0.05, detail=cb.snapshot)
        assert cb.totals() == {}
        assert cb.snapshot()["other_gateways"] == 0
    finally:
        await rb.close()


async def test_redis_killed_and_restarted_under_load(redis_server):
    ra, ca = await gateway(redis_server.url, "gw-a", 1)
    rb, cb = await gateway(redis_server.url, "gw-b", 2)
    stop = asyncio.Event()
    picks = {"ok": 0}

    async def traffic(r):
        held = []
        while not stop.is_set():
            held.append(await r.pick(RouteRequest("m")))  # an exception here fails the test
            picks["ok"] += 1
            if len(held) > 3:
                await r.release(held.pop(0))
            await asyncio.sleep(0.002)
        return held

    try:
        tasks = [asyncio.create_task(traffic(ra)), asyncio.create_task(traffic(rb))]
        await wait_until_async(lambda: picks["ok"] > 50)
        redis_server.kill()
        before = picks["ok"]
        await wait_until_async(lambda: not ca.up and not cb.up)
        await wait_until_async(lambda: picks["ok"] > before + 100)
        assert not ca.up and not cb.up, (ca.snapshot(), cb.snapshot())
        redis_server.start()  # empty: every gateway must republish its counts
        assert await wait_until_async(lambda: ca.up and cb.up, detail=lambda: (ca.snapshot(), cb.snapshot()))
        stop.set()
        held_a, held_b = await asyncio.gather(*tasks)
        assert picks["ok"] > before + 100

        async def agreed():
            await ca.flush(), await cb.flush()
            return await converged(ca, cb)
        await wait_until_async(agreed, timeout=10, interval=0.05, detail=lambda: (ca.snapshot(), cb.snapshot()))
        expected = {}
        for d in held_a + held_b:
            expected[d.pod.name] = expected.get(d.pod.name, 0) + 1
        assert ca.totals() == cb.totals() == expected, (ca.snapshot(), cb.snapshot(), expected)
        for d in held_a:
            await ra.release(d)
        for d in held_b:
            await rb.release(d)
        # Reads are cached for a few ms and a write may still be in its backoff: poll, bounded.
        async def agreed_on_none() -> bool:
            return await agreed() and ca.totals() == {}
        await wait_until_async(agreed_on_none, timeout=10, interval=0.05,
                               detail=lambda: (ca.snapshot(), cb.snapshot()))
        assert ca.totals() == cb.totals() == {}, (ca.snapshot(), cb.snapshot())
    finally:
        stop.set()
        await ra.close()
        await rb.close()


async def test_a_gateway_on_kvgates_client_and_one_on_redis_py_share_their_counts(redis_server):
    """The same keys, scripts and channel whichever client a gateway uses (a URL with a redis-py option keeps
    redis-py): mixed replicas agree, each reading the other's counts once it heard the other's write (notified:
    no read otherwise within two heartbeats)."""
    ra, ca = await gateway(redis_server.url, "gw-lean", notified=True, heartbeat_s=1.0)
    rb, cb = await gateway(redis_server.url + "?health_check_interval=0", "gw-redis-py", notified=True,
                           heartbeat_s=1.0)

    async def agree(total: int) -> bool:
        await ca.refresh(), await cb.refresh()
        return ca.totals() == cb.totals() and sum(ca.totals().values()) == total

    try:
        assert ca.snapshot()["client"] == "kvgate" and cb.snapshot()["client"] == "redis-py"
        await wait_until_async(lambda: ca.listening and cb.listening, timeout=10)
        held_a = [await ra.pick(RouteRequest("m")) for _ in range(2)]
        held_b = [await rb.pick(RouteRequest("m")) for _ in range(3)]
        assert await ca.flush() and await cb.flush()
        await wait_until_async(lambda: agree(5), timeout=1.5, interval=0.05, detail=lambda: (ca.snapshot(), cb.snapshot()))
        for d in held_a:
            await ra.release(d)
        for d in held_b:
            await rb.release(d)
        assert await ca.flush() and await cb.flush()
        await wait_until_async(lambda: agree(0), timeout=1.5, interval=0.05, detail=lambda: (ca.snapshot(), cb.snapshot()))
    finally:
        await ra.close()
        await rb.close()


async def test_a_stopped_redis_costs_a_pick_nothing_and_the_counts_reconverge_once_it_answers(redis_server):
    """Redis stopped (SIGSTOP: it keeps the connections and answers nothing), as a hung Redis or a partition: a
    write gives up after op_timeout_s (kvgate's own client closes the connection its command waited on), picks
    go on with local counts without waiting on it, and once Redis answers the next writes bring both views back
    to what runs."""
    import os
    import signal
    ra, ca = await gateway(redis_server.url, "gw-a", op_timeout_s=0.2)
    rb, cb = await gateway(redis_server.url, "gw-b", op_timeout_s=0.2)
    try:
        assert ca.snapshot()["client"] == "kvgate"  # the lean client (redis://)
        held = [await ra.pick(RouteRequest("m")) for _ in range(2)]
        assert await ca.flush()
        await cb.refresh()
        assert sum(cb.totals().values()) == 2
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert not await ca.flush()
            assert time.monotonic() - started < 1.5 and not ca.up
            t0 = time.monotonic()
            more = [await rb.pick(RouteRequest("m")) for _ in range(3)]
            assert time.monotonic() - t0 < 1.0, "a pick waited on the stopped Redis"
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)

        async def agreed():
            await ca.flush(), await cb.flush()
            return await converged(ca, cb)
        await wait_until_async(agreed, timeout=10, interval=0.05, detail=lambda: (ca.snapshot(), cb.snapshot()))
        assert sum(ca.totals().values()) == 5 and ca.up and cb.up
        for d in held:
            await ra.release(d)
        for d in more:
            await rb.release(d)

        async def none_left():
            return await agreed() and ca.totals() == {}
        await wait_until_async(none_left, timeout=10, interval=0.05, detail=lambda: (ca.snapshot(), cb.snapshot()))
    finally:
        await ra.close()
        await rb.close()


async def test_redis_down_from_the_start_means_local_counts():
    counts = RedisCounts(f"redis://127.0.0.1:{free_port()}/0", "gw-x", **FAST)
    r = Router(PodRegistry(pods(2)), default_strategy="least-request", counts=counts, seed=0)
    await r.start()
    try:
        ds = [await r.pick(RouteRequest("m")) for _ in range(4)]
        assert r.running() == {"p0": 2, "p1": 2}
        assert counts.up is False and counts.failures >= 1
        for d in ds:
            await r.release(d)
        assert r.running() == {}
    finally:
        await r.close()


async def test_auth_url_works_and_password_is_never_logged(caplog):
    server = RedisServer(password="s3cret-pw")
    server.start()
    try:
        caplog.set_level(logging.DEBUG)
        good = RedisCounts(server.url, "gw-auth", **FAST)
        good.add("p0", 1)
        assert await good.flush() and good.up
        bad = RedisCounts(server.url.replace("s3cret-pw", "wrong-pw"), "gw-bad", **FAST)
        assert not await bad.flush()
        assert "s3cret-pw" not in str(good.snapshot()) and "wrong-pw" not in str(bad.snapshot())
        await good.close()
        await bad.close()
        assert "s3cret-pw" not in caplog.text and "wrong-pw" not in caplog.text
        assert "***" in caplog.text  # the failure was logged, redacted
    finally:
        server.kill()




def _tls_server(certs: dict) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(certs["cert"]), "--tls-key-file", str(certs["key"]),
                             "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, timeout=10, proc=proc, name="redis-server (TLS)")
    except StackError:
        if proc.poll() is not None:
            pytest.skip("this redis-server has no TLS support")
        proc.kill()
        raise
    return proc, port


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
async def test_tls_url(tmp_path):
    """rediss:// with the server's CA given in the URL (redis-py's ssl_ca_certs query option); the
    certificates pass strict X.509 verification (Python 3.13's default)."""
    certs = make_tls_certs(tmp_path)
    proc, port = _tls_server(certs)
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca']}"
        a, b = RedisCounts(url, "tls-a", **FAST), RedisCounts(url, "tls-b", **FAST)
        assert a.snapshot()["client"] == "redis-py"  # TLS stays on redis-py
        a.add("p0", 2)
        assert await a.flush(), "no TLS connection with certificates that should pass"
        await b.refresh()
        assert b.totals() == {"p0": 2}
        await a.close()
        await b.close()
    finally:
        proc.kill()
        proc.wait(5)


async def test_stale_view_is_reread_in_the_background_without_holding_the_pick(redis_server):
    a = RedisCounts(redis_server.url, "gw-a", **FAST)
    b = RedisCounts(redis_server.url, "gw-b", **{**FAST, "stale_ok_s": 5.0})
    try:
        await b.refresh()  # no view yet: this one waits for the read
        assert b.totals() == {} and b.snapshot()["others_age_s"] is not None
        a.add("p0", 3)
        assert await a.flush()
        # The view is stale (read_max_age_s 0) but usable: refresh returns at once, without awaiting Redis ...
        call = b.refresh()
        with pytest.raises(StopIteration):
            call.send(None)
        assert b.totals() == {}
        # ... and the read it started brings A's count for the next picks.
        assert await wait_until_async(lambda: b.totals() == {"p0": 3}, timeout=5)
    finally:
        await a.close()
        await b.close()


async def test_every_write_brings_the_other_gateways_counts_back(redis_server):
    a = RedisCounts(redis_server.url, "gw-a", **FAST)
    b = RedisCounts(redis_server.url, "gw-b", **FAST)
    reads = []
    real_read = b._read

    async def counting_read(keys, args):
        reads.append(1)
        return await real_read(keys=keys, args=args)

    b._read = counting_read
    try:
        a.add("p0", 3)
        assert await a.flush()
        b.add("p1", 1)
        assert await b.flush()  # the write's answer is the view: no read of its own
        assert b.totals() == {"p0": 3, "p1": 1} and b.snapshot()["other_gateways"] == 1 and not reads
        assert await a.flush() and a.totals() == {"p0": 3, "p1": 1}
    finally:
        await a.close()
        await b.close()


async def test_a_stale_picks_view_comes_from_the_writer_after_its_interval_by_the_write_due_else_a_read(redis_server):
    a = RedisCounts(redis_server.url, "gw-a", **FAST)
    # a heartbeat long past the test: a heartbeat's write landing between the stale pick and the write due would
    # bring the view instead of the read this test waits for (seen in CI, a loaded machine)
    b = RedisCounts(redis_server.url, "gw-b",
                    **{**FAST, "stale_ok_s": 5.0, "write_interval_s": 0.05, "heartbeat_s": 2.0})
    reads = []
    real_read = b._read

    async def counting_read(keys, args):
        reads.append(1)
        return await real_read(keys=keys, args=args)

    b._read = counting_read
    try:
        await b.refresh()  # no view yet: this one waits for a read
        assert reads == [1]
        await b.start()
        a.add("p0", 2)
        assert await a.flush()
        b.add("p1", 1)  # a pick: its change is due to be written
        await b.refresh()  # the view is stale (read_max_age_s 0), a write is due: it brings the view, no read
        assert await wait_until_async(lambda: b.totals() == {"p0": 2, "p1": 1}, timeout=5)
        assert reads == [1]
        # nothing to write: the writer reads, once its interval is over
        assert await wait_until_async(lambda: not b._dirty.is_set() and not b._write_lock.locked(), timeout=5)
        await b.refresh()
        assert await wait_until_async(lambda: len(reads) == 2, timeout=5)
    finally:
        await a.close()
        await b.close()


async def test_a_burst_of_changes_goes_out_as_one_write(redis_server):
    # the heartbeat past the test: the burst goes out by the write due, and no heartbeat's write lands beside it
    a = RedisCounts(redis_server.url, "gw-a", **{**FAST, "write_interval_s": 1.0, "heartbeat_s": 2.0})
    b = RedisCounts(redis_server.url, "gw-b", **FAST)
    writes: list[dict] = []
    real_flush = a.flush

    async def counting_flush() -> bool:
        writes.append(a.local())
        return await real_flush()

    a.flush = counting_flush
    try:
        await a.start()
        assert await wait_until_async(lambda: len(writes) == 1)  # the start-up write
        for _ in range(10):  # picks spread over 50 ms, all inside one write interval
            a.add("p0", 1)
            await asyncio.sleep(0.005)
        assert await wait_until_async(lambda: len(writes) == 2, timeout=5)
        assert writes[1] == {"p0": 10} and len(writes) == 2
        await b.refresh()
        assert b.totals() == {"p0": 10}
    finally:
        await a.close()
        await b.close()


async def test_a_request_that_begins_and_ends_within_the_write_interval_is_never_written(redis_server):
    a = RedisCounts(redis_server.url, "gw-a", **{**FAST, "heartbeat_s": 2.0, "write_interval_s": 0.1})
    writes: list[dict] = []
    real_flush = a.flush

    async def counting_flush() -> bool:
        writes.append(a.local())
        return await real_flush()

    a.flush = counting_flush
    try:
        await a.start()
        assert await wait_until_async(lambda: len(writes) == 1)  # the start-up write
        a.add("p0", 1)  # picked ...
        await asyncio.sleep(0.02)
        a.add("p0", -1)  # ... and released before its change went out
        await asyncio.sleep(0.4)
        assert writes == [{}]
        a.add("p0", 1)  # one that lasts is written, once the interval is over
        assert await wait_until_async(lambda: len(writes) == 2, timeout=5)
        assert writes[1] == {"p0": 1}
    finally:
        await a.close()


async def test_a_flush_is_never_overtaken_by_an_older_write_in_flight(redis_server):
    """The background writer's write may be on its way when flush() is called: the two go one after the
    other (a whole-state rewrite landing out of order would leave the older state in Redis)."""
    a = RedisCounts(redis_server.url, "gw-a", **FAST)
    b = RedisCounts(redis_server.url, "gw-b", **FAST)
    real_sync = a._sync
    first_taken, release = asyncio.Event(), asyncio.Event()
    in_flight = {"now": 0, "max": 0}

    async def held_first_write(keys, args):
        in_flight["now"] += 1
        in_flight["max"] = max(in_flight["max"], in_flight["now"])
        try:
            if not first_taken.is_set():
                first_taken.set()
                await release.wait()  # the older write, held on its way to Redis
            return await real_sync(keys=keys, args=args)
        finally:
            in_flight["now"] -= 1

    a._sync = held_first_write
    try:
        a.add("p0", 1)
        older = asyncio.create_task(a.flush())
        await first_taken.wait()
        a.add("p0", 1)
        newer = asyncio.create_task(a.flush())
        for _ in range(10):  # loop turns enough for the newer write to reach Redis if nothing holds it
            await asyncio.sleep(0)
        release.set()
        assert await older and await newer
        assert in_flight["max"] == 1
        await b.refresh()
        assert b.totals() == {"p0": 2}
    finally:
        release.set()
        await a.close()
        await b.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
async def test_certificate_that_fails_verification_is_named_in_one_clear_error(tmp_path, caplog):
    """The server's certificate is not from the CA the URL gives: local counts, and one ERROR line
    saying what failed (verification of which Redis) and why (OpenSSL's own words), not a bare
    ConnectionError."""
    certs = make_tls_certs(tmp_path, "server")
    other = make_tls_certs(tmp_path, "other")
    proc, port = _tls_server(certs)
    caplog.set_level(logging.INFO, logger="routing.state.counts")
    try:
        c = RedisCounts(f"rediss://:pw@127.0.0.1:{port}/0?ssl_ca_certs={other['ca']}", "tls-bad", **FAST)
        c.add("p0", 1)
        assert not await c.flush() and not await c.flush()
        assert c.totals() == {"p0": 1} and not c.up
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, caplog.text
        assert "TLS certificate verification of Redis rediss://:***@127.0.0.1" in errors[0]
        # OpenSSL's reason (the server sends its CA along, which the given CA does not vouch for).
        assert ("self-signed certificate in certificate chain (OpenSSL verify code 19)" in errors[0]
                or "unable to get local issuer certificate (OpenSSL verify code 20)" in errors[0]), errors[0]
        assert "ssl_ca_certs" in errors[0]
        await c.close()
    finally:
        proc.kill()
        proc.wait(5)


async def test_the_gateways_counts_use_a_view_as_old_as_the_key_ttl_without_a_redis_round_trip(redis_server):
    # kvgate serve's own settings: a pick after a pause longer than the heartbeat (but within the TTL, within which
    # totals() trusts the others' counts) starts a read for the next picks and does not wait for it
    from plugin.app import running_counts
    from plugin.config import Settings
    from routing.metrics import RoutingMetrics

    settings = Settings.from_env({"KVGATE_REDIS_URL": redis_server.url, "KVGATE_REDIS_KEY_TTL_S": "1",
                                  "KVGATE_PODS": "[]"})
    counts = running_counts(settings, RoutingMetrics())
    try:
        await counts.refresh()  # no view yet: this one waits
        assert await wait_until_async(lambda: counts.snapshot()["others_age_s"] > 0.5, timeout=5)
        call = counts.refresh()
        with pytest.raises(StopIteration):
            call.send(None)
    finally:
        await counts.close()


async def _counting_reads(counts: RedisCounts) -> list:
    reads: list = []
    real_read = counts._read

    async def counting_read(keys, args):
        reads.append(1)
        return await real_read(keys=keys, args=args)

    counts._read = counting_read
    return reads


async def test_a_notified_gateway_reads_only_once_another_gateway_has_written(redis_server):
    # kvgate serve's reading: a stale view is read again only once another gateway's write was heard on the channel
    a = RedisCounts(redis_server.url, "gw-a", **FAST)
    b = RedisCounts(redis_server.url, "gw-b", **{**FAST, "stale_ok_s": 5.0, "notified": True})
    reads = await _counting_reads(b)
    try:
        await b.start()
        assert await wait_until_async(lambda: b.listening, timeout=5)
        await b.refresh()  # listening began: whatever was written before is read once
        assert await wait_until_async(lambda: len(reads) == 1 and b._reading is None, timeout=5)
        n = len(reads)
        for _ in range(20):  # stale by age (read_max_age_s 0), but nobody wrote: no read
            await b.refresh()
            await asyncio.sleep(0.005)
        b.add("p1", 1)  # its own writes tell it nothing new either
        assert await b.flush()
        for _ in range(5):
            await b.refresh()
            await asyncio.sleep(0.005)
        assert len(reads) == n, reads
        a.add("p0", 2)
        assert await a.flush()  # heard: the next pick reads
        assert await wait_until_async(lambda: b._heard != b._view_heard, timeout=5)
        await b.refresh()
        assert await wait_until_async(lambda: b.totals() == {"p0": 2, "p1": 1}, timeout=5)
        assert len(reads) == n + 1 and b.snapshot()["listening"]
    finally:
        await a.close()
        await b.close()


async def test_a_notified_gateway_reads_by_age_while_not_listening_and_listens_again_after_redis_returns(redis_server):
    a = RedisCounts(redis_server.url, "gw-a", **FAST)
    b = RedisCounts(redis_server.url, "gw-b", **{**FAST, "stale_ok_s": 5.0, "notified": True})
    try:
        await b.start()
        assert await wait_until_async(lambda: b.listening, timeout=5)
        redis_server.kill()
        assert await wait_until_async(lambda: not b.listening, timeout=5)
        redis_server.start()  # empty
        a.add("p0", 1)
        assert await wait_until_async(a.flush, timeout=10, interval=0.05)

        async def read_by_now() -> bool:  # listening or not, the view comes to hold a's count
            await b.refresh()
            return b.totals() == {"p0": 1}
        assert await wait_until_async(read_by_now, timeout=10, interval=0.05, detail=b.snapshot)
        assert await wait_until_async(lambda: b.listening, timeout=10, detail=b.snapshot)
        a.add("p0", 1)
        assert await a.flush()
        assert await wait_until_async(lambda: _refreshed(b, {"p0": 2}), timeout=5,
                                      interval=0.02, detail=b.snapshot)
    finally:
        await a.close()
        await b.close()


async def _refreshed(counts: RedisCounts, expected: dict) -> bool:
    await counts.refresh()
    return counts.totals() == expected


async def test_a_dead_gateways_counts_leave_a_notified_view_within_two_heartbeats_of_its_key_expiring(redis_server):
    ra, ca = await gateway(redis_server.url, "gw-dead", ttl_s=1.0)
    cb = RedisCounts(redis_server.url, "gw-alive", **{**FAST, "stale_ok_s": 5.0, "notified": True})
    try:
        await cb.start()
        assert await wait_until_async(lambda: cb.listening, timeout=5)
        for _ in range(3):
            await ra.pick(RouteRequest("m"))
        await ca.flush()
        assert await wait_until_async(lambda: _refreshed(cb, {p: n for p, n in ca.local().items()}), timeout=5,
                                      interval=0.02)
        await ca.close(unregister=False)  # stops heartbeating and publishing: nothing more is heard from it
        assert await wait_until_async(lambda: _refreshed(cb, {}), timeout=10, interval=0.05, detail=cb.snapshot)
    finally:
        await ra.close()
        await cb.close()


async def test_a_redis_user_without_channel_rights_still_shares_counts_read_by_age(redis_server):
    # Redis 7 gives a new ACL user no channels: the write's PUBLISH fails inside the script, the write stands, and a
    # notified gateway that cannot subscribe reads by age, as without the channel
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command("ACL", "SETUSER", "counts", "on", ">pw", "~*", "+@all", "resetchannels")
    await admin.aclose()
    url = redis_server.url.replace("redis://", "redis://counts:pw@")
    a = RedisCounts(url, "gw-a", **FAST)
    b = RedisCounts(url, "gw-b", **{**FAST, "stale_ok_s": 5.0, "notified": True})
    try:
        await b.start()
        a.add("p0", 2)
        assert await a.flush() and a.up
        assert await wait_until_async(lambda: _refreshed(b, {"p0": 2}), timeout=5, interval=0.02, detail=b.snapshot)
        assert not b.listening
        a.add("p0", 1)
        assert await a.flush()
        assert await wait_until_async(lambda: _refreshed(b, {"p0": 3}), timeout=5, interval=0.02, detail=b.snapshot)
    finally:
        await a.close()
        await b.close()
