"""Block keys (kvcache/csrc/blockkeys.c, chain_keys): a whole prompt's keys equal the block-by-block
reference chain (kvcache/blockkeys.py's reference_chain_keys), four blocks hashed at a time report a bad
token id in prompt order, every block and the block order count, and integer buffers read like lists."""
from __future__ import annotations

import random

import pytest

from kvcache.blockkeys import KEY_MASK, block_keys, chain_keys, reference_chain_keys, root_key


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_batch_keys_equal_the_incremental_chain(block_size):
    rng = random.Random(block_size)
    for n_blocks in [0, 1, 2, 23, 24, 25, 100, 600]:
        tokens = [rng.randrange(1 << rng.choice((8, 17, 40))) for _ in range(n_blocks * block_size + rng.randrange(block_size))]
        parent = rng.getrandbits(60)
        want, k = [], parent
        for i in range(n_blocks):
            k = reference_chain_keys(k, tokens[i * block_size:(i + 1) * block_size], block_size)[0]  # one block on its own
            want.append(k)
        assert chain_keys(parent, tokens, block_size) == want
        assert all(0 <= x <= KEY_MASK for x in want)
    assert block_keys("m", None, list(range(64)), 4) == chain_keys(root_key("m", None), list(range(64)), 4)


def test_a_bad_token_id_is_reported_in_prompt_order():
    """Blocks are hashed four at a time; the error is still the first bad id's in prompt order (a
    str in block 1 at position 5, before an out-of-range id at the start of block 2)."""
    tokens = list(range(16)) + [1] * 5 + ["x"] + [1] * 10 + [2**70] + [1] * 15 + [3] * 16
    with pytest.raises(TypeError, match="token ids must be ints, got str"):
        chain_keys(0, tokens, 16)
    with pytest.raises(OverflowError):
        chain_keys(0, tokens[:21] + [1] + tokens[22:], 16)


def test_keys_depend_on_block_order_and_every_block():
    base = list(range(40 * 4))
    keys = chain_keys(7, base, 4)
    assert len(set(keys)) == 40
    swapped = base[4:8] + base[:4] + base[8:]
    assert chain_keys(7, swapped, 4)[1:] != keys[1:] and chain_keys(7, swapped, 4)[2:] != keys[2:]
    changed = base[:]
    changed[0] += 1
    assert all(a != b for a, b in zip(chain_keys(7, changed, 4), keys))
    with pytest.raises(ValueError):
        block_keys("m", None, base, 0)


def test_chain_keys_read_integer_buffers_like_lists():
    """array.array and numpy token ids give the same keys as a list of ints; float buffers are refused."""
    from array import array

    import numpy as np
    from kvcache.blockkeys import reference_chain_keys

    tokens = [0, 1, 65535, 70000, 2**31 - 1, 5, 9, 12]
    want = reference_chain_keys(11, tokens, 2)
    for buf in (array("I", tokens), array("q", tokens), np.array(tokens, np.int64), np.array(tokens, np.uint32)):
        assert chain_keys(11, buf, 2) == want
    assert chain_keys(11, array("i", [-3, 4]), 2) == reference_chain_keys(11, [-3, 4], 2)
    with pytest.raises(TypeError):
        chain_keys(11, np.array([1.0, 2.0]), 1)
