"""A request's block extras reach the index (routing.scheduling's prefix and slo scorers, through
kvcache.locking.LockedIndex as the gateway wires it): `extras=` on match and match_ranks when the request has
some, the plain call (no keyword) when it has none."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvcache.blockkeys import BlockExtras, MediaItem
from kvcache.index import PrefixMatch
from kvcache.locking import IndexLock, LockedIndex
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.scoring import RouteRequest

TOKENS = list(range(64))
SALTED = BlockExtras(cache_salt="tenant-1")
MEDIA = BlockExtras(media=(MediaItem("img", 16, 20),))


@dataclass
class RecordingIndex:
    """The index as the lead's PrefixIndex takes it: records every call with its keywords; pod "a" (rank 1 of a
    data-parallel pod) holds 2 blocks of anything."""

    calls: list = field(default_factory=list)

    def match(self, model, lora, token_ids, pods, **kw):
        pods = list(pods)
        self.calls.append(("match", model, tuple(pods), kw))
        return {p: PrefixMatch(2 if p == "a" else 0, {"GPU": 2} if p == "a" else {}, 4) for p in pods}

    def match_ranks(self, model, lora, token_ids, targets, **kw):
        targets = list(targets)
        self.calls.append(("match_ranks", model, tuple(targets), kw))
        return {t: PrefixMatch(2 if t == ("a", 1) else 0, {"GPU": 2} if t == ("a", 1) else {}, 4) for t in targets}

    def block_size(self, model):
        return 16

    def stats(self):
        return {}


def fleet(dp: bool = False) -> list[Pod]:
    events = KVEventsEndpoint(dp_size=2) if dp else None
    return [Pod("a", "10.0.0.1", 8000, "m", kv_events=events), Pod("b", "10.0.0.2", 8000, "m")]


@pytest.mark.parametrize("strategy", ["kv-sync", "slo"])
@pytest.mark.parametrize("dp", [False, True])
async def test_extras_reach_the_index_only_when_the_request_has_some(strategy, dp):
    index = RecordingIndex()
    router = Router(PodRegistry(fleet(dp)), default_strategy=strategy, index=LockedIndex(index, IndexLock()), seed=0)
    verb = "match_ranks" if dp else "match"
    for extras in (None, SALTED, MEDIA, BlockExtras(opaque=True)):
        index.calls.clear()
        d = await router.pick(RouteRequest("m", TOKENS, extras=extras))
        assert index.calls and {c[0] for c in index.calls} == {verb}
        assert all(c[3] == ({} if extras is None else {"extras": extras}) for c in index.calls)
        assert d.matched_blocks == (2 if (d.pod.name, d.rank) in (("a", None), ("a", 1)) else 0)  # the index's answer
        await router.release(d)


async def test_a_locked_index_passes_extras_through_and_answers_busy_as_before():
    index = RecordingIndex()
    lock = IndexLock()
    locked = LockedIndex(index, lock, wait_s=0.0)
    assert locked.match("m", None, TOKENS, ["a"], extras=SALTED)["a"].blocks == 2
    assert locked.match_ranks("m", "lora", TOKENS, [("a", 1)], extras=MEDIA)[("a", 1)].blocks == 2
    assert locked.match("m", None, TOKENS, ["a"])["a"].blocks == 2
    assert [c[3] for c in index.calls] == [{"extras": SALTED}, {"extras": MEDIA}, {}]
    with lock:  # held by the ingest thread: no wait allowed, the answer is "nobody holds anything"
        assert locked.match("m", None, TOKENS, ["a"], extras=SALTED) == {}
        assert locked.match_ranks("m", None, TOKENS, [("a", 1)], extras=SALTED) == {}
    assert len(index.calls) == 3


def test_the_router_side_guess_keys_salts_and_media_too():
    from kvcache.blockkeys import BlockExtras, MediaItem
    from routing.scheduling.approx import ApproxPrefixTable
    table = ApproxPrefixTable(block_size=4)
    tokens = list(range(16))
    plain = table.block_keys("m", None, tokens)
    table.record(table.block_keys("m", None, tokens, BlockExtras(cache_salt="a")), "p0")
    assert table.match(table.block_keys("m", None, tokens, BlockExtras(cache_salt="a")), ["p0"]) == {"p0": 4}
    assert table.match(table.block_keys("m", None, tokens, BlockExtras(cache_salt="b")), ["p0"]) == {"p0": 0}
    assert table.match(plain, ["p0"]) == {"p0": 0}
    img = table.block_keys("m", None, tokens, BlockExtras(media=(MediaItem("x", 5, 4),)))
    assert img[0] == plain[0] and img[1] != plain[1]  # blocks 1 and 2 hold the item's placeholders
    assert table.block_keys("m", None, tokens, BlockExtras(opaque=True)) == []


def test_a_salted_prompt_is_a_family_of_its_own():
    from routing.scheduling.scorers import FamilyAffinityScorer
    from routing.scheduling.scoring import PickContext
    tokens = list(range(40))
    families = set()
    for extras in (None, BlockExtras(cache_salt="u1"), BlockExtras(cache_salt="u2"), BlockExtras(cache_salt="u1")):
        ctx = PickContext(RouteRequest("m", tokens, extras=extras), "m", None, {})
        ctx.total_blocks = 2
        FamilyAffinityScorer().score(ctx, [Pod("a", "10.0.0.1", 8000, "m")])
        families.add(ctx.family)
    assert len(families) == 3


def test_a_salted_or_media_familys_key_is_the_same_in_every_process():
    """Gateway replicas place a family nobody holds by the same rendezvous order only if they compute the same
    family key: for a salted prompt, or one with media in its first block, that key must not depend on the
    process's string-hash seed (PYTHONHASHSEED). Media past the first block leaves the family the plain one."""
    import subprocess
    import sys
    script = (
        "from kvcache.blockkeys import BlockExtras, MediaItem\n"
        "from routing.pods import Pod\n"
        "from routing.scheduling.scorers import FamilyAffinityScorer\n"
        "from routing.scheduling.scoring import PickContext, RouteRequest\n"
        "for extras in (None, BlockExtras(cache_salt='u1'), BlockExtras(media=(MediaItem('img-a', 3, 4),)),\n"
        "               BlockExtras(media=(MediaItem('img-a', 20, 4),))):\n"
        "    ctx = PickContext(RouteRequest('m', list(range(40)), extras=extras), 'm', None, {})\n"
        "    FamilyAffinityScorer().score(ctx, [Pod('a', '10.0.0.1', 8000, 'm')])\n"
        "    print(ctx.family)\n")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout.split()
            for seed in ("1", "2")]
    assert runs[0] == runs[1]
    plain, salted, media_first, media_later = runs[0]
    assert len({plain, salted, media_first}) == 3 and media_later == plain
