"""Events as split_batch's parts hold them, joined back for comparison with the batch they came from."""
from __future__ import annotations

import dataclasses

from kvcache.events import BlockRemoved, BlockStored


def merged(events) -> list:
    """Pieces of cut events joined back (on both sides of a comparison: events the batch had side by
    side join too): a store chained to the last block of the store before it, all else equal,
    continues it, as a removal continues the removal before it, all else equal."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if type(e) is not type(last) or _rest(e) != _rest(last):
            out.append(e)
        elif isinstance(e, BlockRemoved):
            out[-1] = dataclasses.replace(last, block_hashes=last.block_hashes + e.block_hashes)
        elif isinstance(e, BlockStored) and e.parent_block_hash == last.block_hashes[-1]:
            out[-1] = dataclasses.replace(last, block_hashes=last.block_hashes + e.block_hashes,
                                          token_ids=last.token_ids + e.token_ids)
        else:
            out.append(e)
    return out


def _rest(e):
    """What a cut leaves as it was."""
    if isinstance(e, BlockStored):
        return dataclasses.replace(e, block_hashes=(), parent_block_hash=None, token_ids=())
    if isinstance(e, BlockRemoved):
        return dataclasses.replace(e, block_hashes=())
    return e
