"""`kvgate serve`'s start-up: what it leaves for the garbage collector."""
from __future__ import annotations

import gc
import weakref

from plugin.serve import settle_heap


class _Node:
    pass


def test_settle_heap_collects_garbage_then_freezes_what_lives() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    kept = [_Node() for _ in range(100)]
    try:
        frozen = settle_heap()
        assert dead() is None  # garbage was collected before freezing, not kept forever
        assert frozen == gc.get_freeze_count() and len(gc.get_objects()) < frozen // 10
        assert not any(obj is kept for obj in gc.get_objects())  # frozen objects are out of the collector's passes
    finally:
        gc.unfreeze()
    assert any(obj is kept for obj in gc.get_objects())
