"""routing.scheduling.family.SharedOpening: the opening most prompts of a model share, past which a prompt's
family starts (the `affinity` scorer's)."""
from __future__ import annotations

import random

import pytest

from kvcache.blockkeys import block_keys
from routing.scheduling.family import SharedOpening

BS = 16
MODEL = "m"


def tokens(seed, blocks: int, extra: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 60000) for _ in range(blocks * BS + extra)]


def opening_keys(prompt: list[int]) -> list[int]:
    return block_keys(MODEL, None, prompt[:33 * BS], BS)


def test_the_shared_opening_is_learnt_from_recent_prompts():
    template = tokens(0, 1, extra=0)  # one block every prompt begins with (a chat template's opening)
    tenants = [template + tokens(10 + t, 20, extra=0) for t in range(12)]
    opening = SharedOpening(window=32, least=8)
    rng = random.Random(1)
    depths = [opening.depth(MODEL, opening_keys(rng.choice(tenants) + tokens(rng.random(), 3))) for _ in range(60)]
    assert depths[:8] == [None] * 8  # too few prompts to tell
    assert set(depths[8:]) == {1}  # then the template, whichever tenant
    # one prompt of another shape (no template) does not undo it
    assert opening.depth(MODEL, opening_keys(tokens(5, 10))) == 0
    assert opening.depth(MODEL, opening_keys(tenants[3] + tokens(6, 2))) == 1
    # models are apart; the window forgets: counts never grow past it
    assert opening.depth("other", opening_keys(tenants[0])) is None
    seen = opening._seen[MODEL]
    assert len(seen[0]) == 32 and sum(seen[1].values()) == sum(len(p) for p in seen[0])


def test_a_tenant_sending_most_prompts_has_its_own_conversations_as_families():
    template = tokens(0, 1, extra=0)
    big, small = template + tokens(1, 10, extra=0), template + tokens(2, 10, extra=0)
    opening = SharedOpening(window=20, share=0.75, least=8)
    for i in range(18):
        opening.depth(MODEL, opening_keys(big + tokens(100 + i, 2)))
    for i in range(2):
        opening.depth(MODEL, opening_keys(small + tokens(200 + i, 2)))
    assert opening.depth(MODEL, opening_keys(big + tokens(300, 2))) == 11  # 17 of 20 share its system prompt
    assert opening.depth(MODEL, opening_keys(small + tokens(301, 2))) == 1


@pytest.mark.parametrize("bad", [dict(window=4, least=8), dict(share=0.0), dict(max_blocks=0), dict(models=0)])
def test_shared_opening_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        SharedOpening(**bad)
