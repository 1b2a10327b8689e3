"""PrefixIndex equals a brute-force model of every engine's cache after long random event
sequences: stores (duplicates, orphans, LoRA, mixed media), removals, clears, restarts, pods
leaving, over two models with data-parallel ranks and engines with different hash functions."""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import pytest

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.index import PrefixIndex

MODELS = {"m4": 4, "m2": 2}  # model -> block size
PODS = {"p0": ("m4", 2), "p1": ("m4", 1), "p2": ("m4", 1), "p3": ("m2", 2), "p4": ("m2", 1)}  # pod -> (model, ranks)
LORAS = (None, "a", "b")
MEDIA = ("GPU", "CPU")
VOCAB = 3  # tiny vocabulary: prefixes are shared often


@dataclass
class Engine:
    """One (pod, rank)'s cache as the engine sees it."""
    seed: int
    # engine hash -> (identity, media held, visible to the router); identity = (scope, lora,
    # prefix tokens), scope the model for a known chain or "orphanN" for a chain under an unknown parent
    blocks: dict = field(default_factory=dict)
    stores: list = field(default_factory=list)  # events sent, for duplicates

    def engine_hash(self, identity):
        scope, lora, prefix = identity
        # like vLLM, the engine's hash does not include the model: models may share hashes
        what = (lora, prefix) if scope in MODELS else identity
        d = hashlib.blake2b(repr((self.seed, what)).encode(), digest_size=32).digest()
        kind = self.seed  # vLLM's three hash shapes: uint64, 32 raw bytes, signed int (< 0.10.2)
        if kind == 0:
            return int.from_bytes(d[-8:], "big")
        if kind == 1:
            return d
        return int.from_bytes(d[:8], "big", signed=True)


class Fleet:
    def __init__(self, rng: random.Random, media=MEDIA, loras=LORAS, hash_kinds=(0, 1, 2), pods=PODS) -> None:
        self.rng = rng
        self.pods = pods
        self.media, self.loras, self.kinds = media, loras, hash_kinds
        self.engines = {(p, r): Engine(rng.choice(hash_kinds)) for p, (_, n) in pods.items() for r in range(n)}
        self.learned: set[str] = set()
        self.fake = 0

    def model(self, pod):
        return self.pods[pod][0]

    # --- events: each returns (pod, rank, events) for the index -----------------------------

    def store(self, pod, rank):
        rng, eng = self.rng, self.engines[(pod, rank)]
        model = self.model(pod)
        bs = MODELS[model]
        held = [(h, b) for h, b in eng.blocks.items()]
        n = rng.randint(1, 4)
        choice = rng.random()
        if choice < 0.06:  # parent nobody ever published (events lost before we subscribed)
            self.fake += 1
            scope, lora, prefix = f"orphan{self.fake}", rng.choice(self.loras), ()
            parent, visible = eng.engine_hash((scope, lora, prefix)), False
        elif held and choice < 0.6:
            parent, ((scope, lora, prefix), _, visible) = rng.choice(held)
        else:
            parent, scope, lora, prefix, visible = None, model, rng.choice(self.loras), (), True
        tokens, hashes = [], []
        medium = rng.choice(self.media + (None,))
        for _ in range(n):
            block = tuple(rng.randrange(VOCAB) for _ in range(bs))
            prefix = prefix + block
            identity = (scope, lora, prefix)
            h = eng.engine_hash(identity)
            hashes.append(h)
            tokens.extend(block)
            _, media, _ = eng.blocks.get(h, (identity, set(), visible))
            media.add(medium or "GPU")
            eng.blocks[h] = (identity, media, visible)
        if lora is not None and lora.startswith("#lora_id="):  # vLLM before 0.14: an adapter id, no name
            ev = BlockStored(tuple(hashes), parent, tuple(tokens), bs, int(lora.split("=")[1]), medium, None)
        else:
            ev = BlockStored(tuple(hashes), parent, tuple(tokens), bs, None, medium, lora)
        eng.stores.append(ev)
        self.learned.add(model)
        return [ev]

    def duplicate(self, pod, rank):
        """A store sent again (replay overlap) or the same blocks offloaded to another medium."""
        eng = self.engines[(pod, rank)]
        ok = [e for e in eng.stores if (e.parent_block_hash is None or e.parent_block_hash in eng.blocks)
              and all(h in eng.blocks for h in e.block_hashes)]
        if not ok:
            return []
        ev = self.rng.choice(ok)
        medium = self.rng.choice(self.media)
        for h in ev.block_hashes:
            eng.blocks[h][1].add(medium)
        return [BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id, medium,
                            ev.lora_name)]

    def remove(self, pod, rank):
        rng, eng = self.rng, self.engines[(pod, rank)]
        if not eng.blocks or rng.random() < 0.05:
            return [BlockRemoved((rng.getrandbits(64),), "GPU")]  # a hash we never saw
        out = []
        for h in rng.sample(sorted(eng.blocks, key=repr), min(len(eng.blocks), rng.randint(1, 3))):
            identity, media, visible = eng.blocks[h]
            m = rng.choice(sorted(media))
            media.discard(m)
            if not media:
                del eng.blocks[h]
            out.append(BlockRemoved((h,), None if m == "GPU" and rng.random() < 0.5 else m))
        return out

    def clear(self, pod, rank):
        self.engines[(pod, rank)] = Engine(self.engines[(pod, rank)].seed)
        return [AllBlocksCleared()]

    def restart(self, pod, rank):
        self.engines[(pod, rank)] = Engine(self.rng.choice(self.kinds))  # a new process may hash differently

    # --- the brute-force answer --------------------------------------------------------------

    def visible(self, pod, rank):
        """(identity, medium) the router can know of."""
        return {(ident, m) for ident, media, vis in self.engines[(pod, rank)].blocks.values() if vis for m in media}

    def expect(self, model, lora, tokens, pods):
        bs = MODELS[model] if model in self.learned else None
        total = len(tokens) // bs if bs else 0
        ids = [(model, lora, tuple(tokens[: (i + 1) * bs])) for i in range(total)]
        out = {}
        for p in pods:
            options = []
            if p in self.pods and self.pods[p][0] == model:
                for r in range(self.pods[p][1]):
                    vis = self.visible(p, r)
                    held_any = {i for i, _ in vis}
                    run = _run(ids, held_any)
                    by_medium = {m: _run(ids, {i for i, mm in vis if mm == m}) for m in self.media}
                    options.append((run, sum(by_medium.values()), {m: n for m, n in by_medium.items() if n}))
            best = max(options, key=lambda o: o[:2], default=(0, 0, {}))
            if best[0] == 0:
                best = (0, 0, {})
            out[p] = (best[0], [o[2] for o in options if o[:2] == best[:2]] or [{}], total)
        return out

    def expect_rank(self, model, lora, tokens, pod, rank):
        """(blocks, by_medium, total) for one (pod, rank)."""
        bs = MODELS[model] if model in self.learned else None
        total = len(tokens) // bs if bs else 0
        if pod not in self.pods or self.pods[pod][0] != model:
            return 0, {}, total
        ids = [(model, lora, tuple(tokens[: (i + 1) * bs])) for i in range(total)]
        vis = self.visible(pod, rank)
        by_medium = {m: _run(ids, {i for i, mm in vis if mm == m}) for m in self.media}
        return _run(ids, {i for i, _ in vis}), {m: n for m, n in by_medium.items() if n}, total

    def entries(self):
        return sum(len(self.visible(p, r)) for (p, r) in self.engines)

    def query(self):
        rng = self.rng
        model = rng.choice(list(MODELS))
        bs = MODELS[model]
        pool = [ident for (p, r), e in self.engines.items() for ident, _, vis in e.blocks.values()
                if vis and ident[0] == model]
        if pool and rng.random() < 0.9:
            _, lora, prefix = rng.choice(pool)
        else:
            lora, prefix = rng.choice(self.loras), ()
        tokens = list(prefix) + [rng.randrange(VOCAB) for _ in range(rng.randrange(3 * bs))]
        pods = rng.sample(list(self.pods) + ["ghost"], rng.randint(1, len(self.pods) + 1))
        return model, lora, tokens, pods


def _run(ids, held):
    n = 0
    for i in ids:
        if i not in held:
            break
        n += 1
    return n


def check(ix: PrefixIndex, fleet: Fleet, queries: int) -> None:
    ix._core.check()  # the C tables' invariants and every count, recomputed the slow way
    assert ix.stats()["entries"] == fleet.entries()
    for _ in range(queries):
        model, lora, tokens, pods = fleet.query()
        got = ix.match(model, lora, tokens, pods)
        want = fleet.expect(model, lora, tokens, pods)
        assert set(got) == set(pods)
        for p in pods:
            blocks, by_medium_options, total = want[p]
            assert (got[p].blocks, got[p].total_blocks) == (blocks, total), (p, model, lora, tokens)
            assert got[p].by_medium in by_medium_options, (p, got[p], by_medium_options)
        # rank by rank (routing to a data-parallel rank): exact, no best-rank choice involved
        targets = [(p, r) for p in pods for r in range(fleet.pods[p][1] if p in fleet.pods else 1)]
        got_ranks = ix.match_ranks(model, lora, tokens, targets)
        assert set(got_ranks) == set(targets)
        for (p, r), m in got_ranks.items():
            assert (m.blocks, m.by_medium, m.total_blocks) == fleet.expect_rank(model, lora, tokens, p, r), (p, r)


def event_stream(fleet: Fleet, ix: PrefixIndex, rng: random.Random, steps: int):
    """(pod, rank, events) batches of random stores, duplicates, removals and clears; engine
    restarts and pods leaving are applied to `ix` directly (they are not events)."""
    slots = list(fleet.engines)
    for _ in range(steps):
        pod, rank = rng.choice(slots)
        x = rng.random()
        if x < 0.45:
            events = fleet.store(pod, rank)
        elif x < 0.55:
            events = fleet.duplicate(pod, rank)
        elif x < 0.9:
            events = fleet.remove(pod, rank)
        elif x < 0.95:
            events = fleet.clear(pod, rank)
        elif x < 0.98:
            fleet.restart(pod, rank)
            ix.drop(pod, rank)
            continue
        else:
            for r in range(fleet.pods[pod][1]):
                fleet.restart(pod, r)
            ix.remove_pod(pod)
            continue
        if rng.random() < 0.3:  # several events in one batch
            events = events + fleet.store(pod, rank)
        yield pod, rank, events


@pytest.mark.parametrize("seed", range(8))
def test_index_equals_brute_force_model(seed):
    rng = random.Random(seed)
    fleet = Fleet(rng)
    ix = PrefixIndex(max_entries=10**9)
    for step, (pod, rank, events) in enumerate(event_stream(fleet, ix, rng, 2500)):
        ix.apply(pod, fleet.model(pod), rank, events)
        if step % 100 == 99:
            check(ix, fleet, 20)
    check(ix, fleet, 200)
    assert ix.stats()["skipped"].get("unknown_parent_blocks", 0) > 0


# more than 64 pod-ranks, many holding the same blocks (holder bitmasks of several words)
WIDE = {f"w{i}": ("m4" if i % 3 else "m2", 1 + (i % 4 == 0) * 3) for i in range(110)}


@pytest.mark.parametrize("seed", range(3))
def test_wide_fleet_equals_brute_force_model(seed):
    """Every fleet size takes the same tables: 110 pods, 191 pod-ranks, the same checks."""
    rng = random.Random(500 + seed)
    fleet = Fleet(rng, pods=WIDE)
    ix = PrefixIndex(max_entries=10**9)
    for step, (pod, rank, events) in enumerate(event_stream(fleet, ix, rng, 4000)):
        ix.apply(pod, fleet.model(pod), rank, events)
        if step % 400 == 399:
            check(ix, fleet, 10)
    check(ix, fleet, 60)
    assert ix.stats()["slots"] > 128


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", ["one-medium", "general"])
def test_raw_batches_equal_brute_force_model(seed, shape):
    """The subscriber's path: events encoded as some vLLM generation emits them, applied with
    apply_payload (native, one pass), or decoded and applied when it declines the batch."""
    from kvcache.wire import GENERATIONS, decode_batch, encode_batch
    from kvcache.events import EventBatch

    rng = random.Random(1000 + seed)
    fleet = (Fleet(rng, media=("GPU",), loras=(None, "a", "#lora_id=7")) if shape == "one-medium"
             else Fleet(rng, loras=LORAS + ("#lora_id=7",)))
    ix = PrefixIndex(max_entries=10**9)
    fast = slow = 0
    for step, (pod, rank, events) in enumerate(event_stream(fleet, ix, rng, 2500)):
        model = fleet.model(pod)
        payload = encode_batch(EventBatch(1.0, tuple(events), rank), rng.choice(GENERATIONS))
        if ix.apply_payload(pod, model, rank, payload) is not None:
            fast += 1
        else:
            slow += 1
            ix.apply(pod, model, rank, decode_batch(payload).batch.events)
        if step % 100 == 99:
            check(ix, fleet, 20)
    check(ix, fleet, 200)
    if shape == "one-medium":
        assert fast > 10 * slow, (fast, slow)  # the clears (and the batches holding one) take the general path
    else:
        assert slow > 0


@pytest.mark.parametrize("seed", range(3))
def test_bounded_index_only_forgets_never_invents(seed):
    """With a small bound, entries never exceed it and every match is at most the truth."""
    rng = random.Random(100 + seed)
    fleet = Fleet(rng)
    ix = PrefixIndex(max_entries=40)
    slots = list(fleet.engines)
    evicted_some = False
    for step in range(3000):
        pod, rank = rng.choice(slots)
        x = rng.random()
        events = fleet.store(pod, rank) if x < 0.6 else fleet.duplicate(pod, rank) if x < 0.7 else fleet.remove(pod, rank)
        ix.apply(pod, fleet.model(pod), rank, events)
        assert ix.stats()["entries"] <= 40
        ix._core.check()
        if step % 10 == 0:
            model, lora, tokens, pods = fleet.query()
            got = ix.match(model, lora, tokens, pods)
            want = fleet.expect(model, lora, tokens, pods)
            for p in pods:
                assert got[p].blocks <= want[p][0]
                assert all(n <= got[p].blocks for n in got[p].by_medium.values())
        evicted_some = evicted_some or ix.stats()["evicted_entries"] > 0
    assert evicted_some
    assert ix.stats()["entries"] <= fleet.entries()


def _apply_messages(ix: PrefixIndex, pod: str, model: str, rank: int, messages: list, counts) -> tuple[int, int]:
    """The subscriber's path for a burst of (seq, payload) messages: runs through apply_run, each message
    it stops before through apply_payload, or decoded and applied. (batches in runs, batches one by one)"""
    from array import array

    from kvcache.wire import decode_batch

    bounds = array("d", (1e-5, 1e-3))
    i = in_runs = single = 0
    while i < len(messages):
        r = ix.apply_run(pod, model, rank, messages, i, messages[i][0], 5, 7, bounds, counts)
        assert r.error is None
        if r.batches:
            i += r.batches
            in_runs += r.batches
            continue
        payload = messages[i][1]
        if ix.apply_payload(pod, model, rank, payload) is None:
            ix.apply(pod, model, rank, decode_batch(payload).batch.events)
        i += 1
        single += 1
    return in_runs, single


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", ["one-medium", "general"])
def test_runs_of_raw_batches_equal_brute_force_model(seed, shape):
    """Bursts of one engine's batches applied as the subscriber applies a recv's worth: runs in one
    native call (apply_run, at most 5 batches or 7 events each), the batches it stops before one by
    one; the index equals the model throughout, and each batch in a run is timed once."""
    from array import array

    from kvcache.events import EventBatch
    from kvcache.wire import GENERATIONS, encode_batch

    rng = random.Random(2000 + seed)
    fleet = (Fleet(rng, media=("GPU",), loras=(None, "a", "#lora_id=7")) if shape == "one-medium"
             else Fleet(rng, loras=LORAS + ("#lora_id=7",)))
    ix = PrefixIndex(max_entries=10**9)
    counts = array("q", bytes(8 * 3))
    done = [0, 0]  # batches applied in runs, one by one
    burst: list = []
    key: list = [None]

    def flush() -> None:
        if burst:
            a, b = _apply_messages(ix, *key[0], burst, counts)
            done[0] += a
            done[1] += b
            burst.clear()

    class Flushing:  # restarts and departures reach the index after the batches sent before them
        def drop(self, pod, rank):
            flush()
            ix.drop(pod, rank)

        def remove_pod(self, pod):
            flush()
            ix.remove_pod(pod)

    for step, (pod, rank, events) in enumerate(event_stream(fleet, Flushing(), rng, 2500)):
        if key[0] != (pod, fleet.model(pod), rank) or rng.random() < 0.2:  # another engine, or the recv ended
            flush()
            key[0] = (pod, fleet.model(pod), rank)
        burst.append((rng.randrange(1 << 40) if not burst else burst[-1][0] + 1,
                      encode_batch(EventBatch(1.0, tuple(events), rank), rng.choice(GENERATIONS))))
        if step % 100 == 99:
            flush()
            check(ix, fleet, 20)
    flush()
    check(ix, fleet, 200)
    in_runs, single = done
    assert sum(counts) == in_runs
    assert in_runs > 2 * single if shape == "one-medium" else in_runs > 0 and single > 0, (in_runs, single)


@pytest.mark.parametrize("generation", ["0.23", "0.33"])
def test_a_run_stops_before_a_batch_that_would_take_it_past_max_blocks(generation):
    """apply_run is one hold of the subscriber's lock: with max_blocks it applies at most that many
    blocks per call (whole batches), whatever max_batches and max_events allow; one-event batches
    (counted from their headers) and several-event ones alike. A batch of more blocks stops it even
    first: the subscriber cuts it (split_payload) and applies the parts one by one. The index ends as if
    each batch were applied alone."""
    from array import array

    from kvcache.events import EventBatch
    from kvcache.native import native
    from kvcache.wire import encode_batch

    def stored(first: int, n: int) -> BlockStored:
        return BlockStored(tuple(range(first, first + n)), first - 1 if first > 1 else None,
                           tuple(range(2 * first, 2 * first + 2 * n)), 2, None, "GPU", None)

    sizes = [[1], [10], [10], [10], [4, 4], [20], [3], [3, 3, 3], [40], [1], [1]]  # events' blocks, batch by batch
    messages, first = [], 1
    for seq, batch in enumerate(sizes, start=7):
        events = []
        for n in batch:
            events.append(stored(first, n))
            first += n
        messages.append((seq, encode_batch(EventBatch(1.0, tuple(events), 0), generation)))
    ix, ref = PrefixIndex(max_entries=10**6), PrefixIndex(max_entries=10**6)
    for _seq, payload in messages:
        assert ref.apply_payload("p", "m", 0, payload) is not None
    counts = array("q", bytes(8 * 3))
    assert ix.apply_payload("p", "m", 0, messages[0][1]) is not None  # the first teaches the index the medium
    runs, i = [], 1
    while i < len(messages):
        r = ix.apply_run("p", "m", 0, messages, i, messages[i][0], 64, 512, array("d", (1e-5, 1e-3)), counts,
                         max_blocks=25)
        assert r.error is None
        if r.batches:
            runs.append([sum(b) for b in sizes[i:i + r.batches]])
            i += r.batches
            continue
        parts = ix.split_payload(messages[i][1], 25)
        runs.append(("parts", [sum(native.scan_batch(p)[1:4:2]) for p in parts]))
        for p in parts:
            assert ix.apply_payload("p", "m", 0, p) is not None
        i += 1
    # 10+10 (a third 10 would pass 25), 10+8 (20 would), 20+3 (9 would), 9, 40 in parts (25 + 15), 1+1
    assert runs == [[10, 10], [10, 8], [20, 3], [9], ("parts", [25, 15]), [1, 1]], runs
    tokens = list(range(2, 2 * first))
    assert ix.match("m", None, tokens, ["p"])["p"].blocks == ref.match("m", None, tokens, ["p"])["p"].blocks == first - 1
    assert ix.stats()["entries"] == ref.stats()["entries"] == first - 1
