"""KV event batches read straight from their bytes (kvcache/csrc/events.c): scan_batch sums up a batch
in the fast path's shape (events and blocks stored and removed, the block size, the one medium, the LoRA
keys of chain-starting stores) alike in vLLM's array and map forms, declines every other shape (None:
the caller decodes it), and Core.apply_batch applies one with the keys kvcache/blockkeys.py defines."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvcache.blockkeys import chain_keys
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcache.native import native
from kvcache.wire import GENERATIONS, encode_batch

GOLDEN = 0x9E3779B97F4A7C15  # the engine hash fold's multiplier (kvcache/index.py's _fold)


def fold(h: int) -> int:
    """An engine block hash as the hash maps key it."""
    h = h * GOLDEN % 2**64
    return h - 2 if h >= 2**64 - 2 else h


def payload(*events, generation: str = "0.23", rank: int | None = 0) -> bytes:
    return encode_batch(EventBatch(1.5, tuple(events), rank), generation)


def stored(hashes, parent=None, bs=4, **fields) -> BlockStored:
    tokens = tuple(range(100 * hashes[0], 100 * hashes[0] + len(hashes) * bs))
    return BlockStored(tuple(hashes), parent, tokens, bs, **fields)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_a_batch_is_summed_up_alike_in_every_generations_form(generation):
    batch = payload(stored((1, 2, 3), lora_id=7), stored((4, 5), parent=3, lora_name="ad"),
                    stored((6,), lora_name="ad2"), BlockRemoved((1, 2, 3, 4, 99)), generation=generation)
    # the LoRA keys of the chain-starting stores only (the second continues a chain: its root is known)
    assert native.scan_batch(batch) == (3, 6, 1, 5, 4, "GPU", {"#lora_id=7", "ad2"})
    assert native.scan_batch(payload(generation=generation)) == (0, 0, 0, 0, 0, None, set())


def test_one_medium_per_batch_and_nil_or_empty_read_as_gpu():
    for medium in (None, "", "GPU"):
        assert native.scan_batch(payload(BlockRemoved((1,), medium), stored((2,), medium="GPU")))[5] == "GPU"
    assert native.scan_batch(payload(BlockRemoved((1,), "CPU"), stored((2,), medium="CPU"))) == \
        (1, 1, 1, 1, 4, "CPU", set())
    assert native.scan_batch(payload(BlockRemoved((1,), "CPU"), stored((2,), medium="GPU"))) is None
    assert native.scan_batch(payload(BlockRemoved((1,), "CPU"), BlockRemoved((2,), None))) is None


def _map_event(**fields) -> dict:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
             "block_size": 2}
    event.update(fields)
    return event


@pytest.mark.parametrize("event, taken", [
    (_map_event(), True),
    (_map_event(session_id="s", locality="x", ownership=None, lookahead_token_ids=None), True),  # known, not modelled
    (_map_event(group_idx=0, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None), True),
    (_map_event(group_idx=1), False),  # another KV cache group: the general path counts it
    (_map_event(other=1), False),  # an unknown field
    (_map_event(type="BlockCleared"), False),  # an unknown tag
    (_map_event(token_ids=[1, 2, 3]), False),  # not block_size ids per block
    (_map_event(block_size=0), False),
    (_map_event(block_hashes=[], token_ids=[]), False),
    (_map_event(lora_id=2**63), False),  # above int64: the general path
    ({"type": "BlockRemoved", "block_hashes": [1], "token_ids": [1]}, False),  # a store's field on a removal
    ({"type": "BlockRemoved", "block_hashes": [1], "locality": "x"}, True),
    ({"type": "AllBlocksCleared"}, False),
    (["BlockStored", [1], None, [1, 2]], False),  # an array store needs its block size
    (["BlockStored", [1], None, [1, 2], 2], True),
    (["BlockStored", [1], None, [1, 2], 2, None, None, None, None, 1], False),  # group 1, array form
    (["BlockRemoved", [1], None, 0], True),
    (["BlockRemoved", [1], None, 0, None], False),  # one field too many
    (["AllBlocksCleared"], False),
])
def test_the_fast_path_takes_its_shape_and_declines_the_rest(event, taken):
    batch = msgpack.packb([1.5, [event], 0])
    assert (native.scan_batch(batch) is not None) == taken, native.scan_batch(batch)


def test_a_repeated_key_or_a_second_block_size_declines_the_batch():
    def with_pair(key: str, value) -> bytes:  # a map event of one more pair, whatever its key
        event = msgpack.packb(_map_event())
        assert event[0] == 0x85
        pair = msgpack.packb(key) + msgpack.packb(value)
        return msgpack.packb([1.5, [], 0])[:-2] + b"\x91\x86" + event[1:] + pair + b"\x00"  # [1.5, [event], 0]

    assert native.scan_batch(with_pair("lora_id", None)) == (1, 1, 0, 0, 2, "GPU", set())
    assert native.scan_batch(with_pair("block_size", 2)) is None
    assert native.scan_batch(payload(stored((1,), bs=4), stored((2,), bs=8))) is None
    assert native.scan_batch(payload(stored((1,), bs=4), stored((2,), bs=4))) is not None
    assert native.scan_batch(payload(stored((1,)), AllBlocksCleared())) is None


def _u64(xs) -> bytes:
    return np.array(xs, np.uint64).tobytes()


def test_apply_batch_stores_the_chained_keys_and_counts_what_it_could_not_apply():
    core = native.Core(1000)
    model, medium = core.new_model(), core.new_medium()
    slot = core.new_slot(core.new_group())
    root = 12345
    first = stored((1, 2, 3))
    assert core.apply_batch(payload(first), model, medium, slot, root, {}) == (3, 0, 0, 0)
    keys = chain_keys(root, first.token_ids, 4)
    assert [core.key_of(model, fold(h)) for h in (1, 2, 3)] == keys
    more = stored((4, 5), parent=3)  # continues the chain at block 3's key
    orphan = stored((7,), parent=99)  # its parent is unknown: never guessed as a chain start
    assert core.apply_batch(payload(more, orphan), model, medium, slot, root, {}) == (2, 0, 1, 0)
    assert [core.key_of(model, fold(h)) for h in (4, 5, 7)] == chain_keys(keys[-1], more.token_ids, 4) + [None]
    lora = stored((8,), lora_name="ad")
    assert core.apply_batch(payload(lora), model, medium, slot, root, {"ad": 777}) == (1, 0, 0, 0)
    assert core.key_of(model, fold(8)) == chain_keys(777, lora.token_ids, 4)[0]
    with pytest.raises(KeyError, match="ad2"):  # a LoRA key scan_batch listed must have its root
        core.apply_batch(payload(stored((9,), lora_name="ad2")), model, medium, slot, root, {})
    assert core.apply_batch(payload(BlockRemoved((1, 4, 50))), model, medium, slot, root, {}) == (0, 2, 0, 1)
    assert core.stats()[0] == 4  # 2, 3, 5 and 8
    assert core.apply_batch(payload(BlockRemoved((2, 51))), model, -1, slot, root, {}) == (0, 0, 0, 1)  # no table
    with pytest.raises(ValueError, match="not in the fast path's shape"):
        core.apply_batch(payload(AllBlocksCleared()), model, medium, slot, root, {})
    core.check()
