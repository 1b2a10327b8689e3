"""routing.state.prompts: the prompts of this gateway's running requests, per target, as held blocks."""
from __future__ import annotations

import random

from kvcache.blockkeys import BlockExtras
from kvcache.events import AllBlocksCleared, BlockStored
from kvcache.index import PrefixIndex
from routing.state.prompts import RunningPrompts

BS = 16
MODEL = "m"


def tokens(seed: int, blocks: int, tail: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 60000) for _ in range(blocks * BS + tail)]


def indexed() -> PrefixIndex:
    """An index that has seen one of MODEL's blocks (it knows the block size) and nothing of the prompts here."""
    index = PrefixIndex()
    index.apply("z", MODEL, 0, [BlockStored((1,), None, tuple(range(BS)), BS)])
    return index


def at(*names: str) -> list[tuple[str, str, int]]:
    return [(n, n.partition("#")[0], int(n.partition("#")[2] or 0)) for n in names]


def test_a_running_prompt_holds_its_full_blocks_on_its_target_until_it_ends():
    prompts = RunningPrompts(indexed())
    system = tokens(1, 10, tail=0)
    first = system + tokens(2, 3)
    prompts.add(1, "a", "a", 0, MODEL, None, first, None)
    second = system + tokens(3, 2)  # shares the system prompt's 10 blocks, not the rest
    assert prompts.held(MODEL, None, second, None, at("a", "b")) == {"a": 10}
    assert prompts.held(MODEL, None, first, None, at("a", "b")) == {"a": 13}  # its own full blocks
    assert prompts.held(MODEL, None, tokens(9, 4), None, at("a", "b")) == {}  # another prompt: nothing
    assert prompts.held(MODEL, "sql", first, None, at("a")) == {}  # an adapter's blocks are other blocks
    prompts.add(2, "a", "a", 0, MODEL, None, second, None)
    prompts.remove(1)
    assert prompts.held(MODEL, None, first, None, at("a")) == {"a": 10}  # the second still holds the system's
    prompts.remove(2)
    prompts.remove(2)  # idempotent
    assert prompts.held(MODEL, None, first, None, at("a")) == {} and len(prompts) == 0


def test_a_cleared_engine_ends_the_claims_made_before_it():
    index = indexed()
    prompts = RunningPrompts(index)
    p = tokens(1, 6)
    prompts.add(1, "a", "a", 0, MODEL, None, p, None)
    prompts.add(2, "b", "b", 0, MODEL, None, p, None)
    index.apply("a", MODEL, 0, [AllBlocksCleared()])  # a's running request keeps its blocks, nobody else hits them
    assert prompts.held(MODEL, None, p, None, at("a", "b")) == {"b": 6}
    prompts.add(3, "a", "a", 0, MODEL, None, p, None)  # a request sent after the clear computes them again
    assert prompts.held(MODEL, None, p, None, at("a", "b")) == {"a": 6, "b": 6}
    prompts.remove(1)  # the one from before the clear ends: the new one's claim stays
    assert prompts.held(MODEL, None, p, None, at("a")) == {"a": 6}
    prompts.remove(3)
    assert prompts.held(MODEL, None, p, None, at("a")) == {}


def test_ranks_are_targets_of_their_own_and_cleared_alone():
    index = indexed()
    prompts = RunningPrompts(index)
    p = tokens(1, 4)
    prompts.add(1, "a#1", "a", 1, MODEL, None, p, None)
    assert prompts.held(MODEL, None, p, None, at("a#0", "a#1")) == {"a#1": 4}
    index.apply("a", MODEL, 0, [AllBlocksCleared()])  # rank 0's cache, not rank 1's
    assert prompts.held(MODEL, None, p, None, at("a#0", "a#1")) == {"a#1": 4}
    index.apply("a", MODEL, 1, [AllBlocksCleared()])
    assert prompts.held(MODEL, None, p, None, at("a#0", "a#1")) == {}


def test_a_request_served_elsewhere_moves_its_claim():
    prompts = RunningPrompts(indexed())
    p = tokens(1, 4)
    prompts.add(1, "a", "a", 0, MODEL, None, p, None)
    prompts.moved(1, "b", "b", 0)
    assert prompts.held(MODEL, None, p, None, at("a", "b")) == {"b": 4}
    prompts.remove(1)
    assert prompts.held(MODEL, None, p, None, at("a", "b")) == {}


def test_prompts_their_tokens_do_not_answer_claim_nothing():
    index = indexed()
    prompts = RunningPrompts(index)
    p = tokens(1, 4)
    prompts.add(1, "a", "a", 0, MODEL, None, p, BlockExtras(cache_salt="s"))  # a salt changes every block's hash
    prompts.add(2, "a", "a", 0, "unknown-model", None, p, None)  # no block size known yet
    prompts.add(3, "a", "a", 0, MODEL, None, tokens(2, 0, tail=9), None)  # no full block
    prompts.add(4, "a", "a", 0, MODEL, None, None, None)  # not tokenized
    assert len(prompts) == 0
    prompts.add(5, "a", "a", 0, MODEL, None, p, None)
    assert prompts.held(MODEL, None, p, BlockExtras(cache_salt="s"), at("a")) == {}
    assert prompts.held(MODEL, None, p, None, at("a")) == {"a": 4}


class OneOfTwoGroups:
    """An index whose model has several KV cache groups (a hybrid model): a hit is not one run of blocks."""

    def block_size(self, model):
        return BS

    def clears(self, pod, rank=0):
        return 0

    def single_group(self, model):
        return False


def test_a_hybrid_models_prompts_claim_nothing():
    prompts = RunningPrompts(OneOfTwoGroups())
    p = tokens(1, 4)
    prompts.add(1, "a", "a", 0, MODEL, None, p, None)
    assert len(prompts) == 0 and prompts.held(MODEL, None, p, None, at("a")) == {}


def test_one_pick_asks_the_running_prompts_once_for_its_candidates_and_again_for_more():
    """running_prompts_held keeps RunningPrompts' answer for the pick, as index_matches keeps the index's: a later
    ask among the same or fewer candidates (slo's safe pods) reads it; one among more asks again."""
    from routing.pods import Pod
    from routing.scheduling.scorers import running_prompts_held
    from routing.scheduling.scoring import PickContext, RouteRequest
    prompts = RunningPrompts(indexed())
    system = tokens(1, 10, tail=0)
    prompts.add(1, "a", "a", 0, MODEL, None, system + tokens(2, 1), None)
    prompts.add(2, "b", "b", 0, MODEL, None, system + tokens(3, 1), None)
    asked = []
    held = prompts.held
    prompts.held = lambda *args: asked.append(args) or held(*args)  # type: ignore[method-assign]
    second = system + tokens(4, 2)
    ctx = PickContext(RouteRequest(MODEL, second), MODEL, None, {})
    n, full = len(second), float(len(second))
    a, b, c = (Pod(x, "10.0.0.1", 8000, MODEL) for x in "abc")
    assert running_prompts_held(prompts, ctx, [a, c], n, BS, {"a": full, "c": full}) == {"a": n - 10 * BS, "c": full}
    assert running_prompts_held(prompts, ctx, [a], n, BS, {"a": full}) == {"a": n - 10 * BS}
    assert len(asked) == 1
    assert running_prompts_held(prompts, ctx, [a, b], n, BS, {"a": full, "b": full}) == {"a": n - 10 * BS,
                                                                                        "b": n - 10 * BS}
    assert len(asked) == 2  # b was not among the candidates asked for: asked again


def test_counted_in_bulk_it_answers_as_counting_every_prompt_afresh_would():
    """Thousands of random starts, ends, moves and clears over three targets (past every rebuild of the bulk
    counts): each answer equals the leading run a prompt shares with the running prompts counted on each target
    since its engine's last clear, worked out from scratch."""
    rng = random.Random(7)
    index = indexed()
    prompts = RunningPrompts(index)
    families = [tokens(100 + f, 6, tail=0) for f in range(4)]
    running: dict[int, tuple[str, int, list[int]]] = {}  # ticket -> (target, clears when counted, prompt)
    targets = ["a", "b", "c"]

    def expected(prompt: list[int]) -> dict[str, int]:
        out = {}
        for t in targets:
            best = 0
            for target, epoch, other in running.values():
                if target == t and epoch == index.clears(t):
                    n = 0
                    while n < len(prompt) // BS and prompt[:(n + 1) * BS] == other[:(n + 1) * BS]:
                        n += 1
                    best = max(best, n)
            if best:
                out[t] = best
        return out

    next_ticket = 0
    for step in range(3000):
        r = rng.random()
        if r < 0.45 or not running:
            prompt = rng.choice(families)[:rng.randrange(1, 7) * BS] + tokens(step, rng.randrange(0, 4))
            t = rng.choice(targets)
            next_ticket += 1
            prompts.add(next_ticket, t, t, 0, MODEL, None, prompt, None)
            running[next_ticket] = (t, index.clears(t), prompt)
        elif r < 0.85:
            ticket = rng.choice(list(running))
            prompts.remove(ticket)
            del running[ticket]
        elif r < 0.97:
            ticket = rng.choice(list(running))
            t = rng.choice(targets)
            prompts.moved(ticket, t, t, 0)
            if running[ticket][0] != t:
                running[ticket] = (t, index.clears(t), running[ticket][2])
        else:
            index.apply(rng.choice(targets), MODEL, 0, [AllBlocksCleared()])
        probe = rng.choice(families) + tokens(-step, 2)
        assert prompts.held(MODEL, None, probe, None, at(*targets)) == expected(probe), step
    assert len(prompts) == len(running)


def test_a_prompt_its_pod_holds_all_but_two_blocks_of_is_counted_here_and_its_listener_hears_keep_alone():
    """held (the index's count for the pick) leaving at most UNTOLD_BLOCKS new full blocks: counted here as any
    other, the listener hears "keep" and nothing of its end, unless it moves to a fallback (then it is told whole);
    three new blocks, or no count, are told."""
    from routing.state.prompts import UNTOLD_BLOCKS
    assert UNTOLD_BLOCKS == 2
    heard: list[list] = []
    prompts = RunningPrompts(indexed())
    prompts.listener = heard.append
    prompt = tokens(1, 12)  # 12 full blocks
    prompts.add(1, "a", "a", 0, MODEL, None, prompt, None, 10)  # two new: kept
    assert prompts.held(MODEL, None, prompt, None, at("a")) == {"a": 12}  # counted here all the same
    prompts.remove(1)
    prompts.remove(1)
    assert heard == [["keep", 1]] and len(prompts) == 0
    prompts.add(5, "a", "a", 0, MODEL, None, prompt, None, 11)  # kept, then served by a fallback: told there, whole
    prompts.moved(5, "b", "b", 0)
    assert prompts.held(MODEL, None, prompt, None, at("a", "b")) == {"b": 12}
    prompts.remove(5)
    assert heard[1:] == [["keep", 5], ["add", 5, "b", "b", 0, prompts._keys(MODEL, None, prompt, None)], ["end", 5]]
    del heard[1:]
    prompts.add(2, "a", "a", 0, MODEL, None, prompt, None, 9)  # three new: told
    prompts.add(3, "a", "a", 0, MODEL, None, prompt, None)  # nobody asked the index: told
    prompts.add(4, "a", "a", 0, MODEL, None, prompt, None, 12)  # every block held already: kept
    prompts.remove(2)
    prompts.remove(4)
    assert [c[:2] for c in heard[1:]] == [["add", 2], ["add", 3], ["keep", 4], ["end", 2]]
