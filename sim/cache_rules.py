"""vLLM's prefix-cache rules for KV cache groups, as small pure functions the simulated engine uses and
tests use as a reference: which blocks a cache hit needs per group kind, the hit across groups, and
which blocks sparse retention hashes. Written from vLLM 0.33's scheduler side
(`kv_cache_coordinator.py` HybridKVCacheCoordinator.find_longest_cache_hit,
`single_type_kv_cache_manager.py` find_longest_cache_hit / reachable_block_mask); see
/work/notes/vllm-facts-25.md. Independent of kvgate's index. Not modelled: EAGLE, fine-grained
(mamba "align" with a finer hash unit) partial hits, chunked local attention.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import gcd

FULL = "full_attention"
SLIDING = "sliding_window"
MAMBA = "mamba"
KINDS = (FULL, SLIDING, MAMBA)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group: its kind (vLLM's `kv_cache_spec_kind`), block size in tokens, and window in
    tokens (sliding_window only)."""
    kind: str
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"GroupSpec.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if type(self.block_size) is not int or self.block_size < 1:
            raise ValueError(f"GroupSpec.block_size must be an int >= 1, got {self.block_size!r}")
        if self.kind == SLIDING:
            if type(self.sliding_window) is not int or self.sliding_window < 1:
                raise ValueError(f"GroupSpec: a sliding_window group needs sliding_window >= 1, "
                                 f"got {self.sliding_window!r}")
        elif self.sliding_window is not None:
            raise ValueError(f"GroupSpec: sliding_window is only for kind {SLIDING!r}, not {self.kind!r}")

    @property
    def sparse(self) -> bool:
        """Whether a hit needs only some blocks before the hit point (so retention may skip others)."""
        return self.kind != FULL


def scheduler_block_size(groups: Sequence[GroupSpec]) -> int:
    """The hit alignment: the LCM of the groups' block sizes."""
    n = 1
    for g in groups:
        n = n * g.block_size // gcd(n, g.block_size)
    return n


def window_blocks(spec: GroupSpec) -> int:
    """Contiguous blocks a sliding-window hit needs right before the hit point (vLLM:
    cdiv(sliding_window - 1, block_size): the token at the hit point is inside its own window)."""
    assert spec.sliding_window is not None
    return -(-(spec.sliding_window - 1) // spec.block_size)


def first_needed_block(spec: GroupSpec, hit: int) -> int:
    """The first block a request reuses in this group for a hit of `hit` tokens; the blocks before it
    are outside the attention (vLLM's get_num_skipped_tokens // block_size)."""
    if spec.kind == SLIDING:
        assert spec.sliding_window is not None
        return max(0, hit - spec.sliding_window + 1) // spec.block_size
    if spec.kind == MAMBA:
        return max(0, hit - 1) // spec.block_size
    return 0


def group_longest_hit(spec: GroupSpec, holds: Callable[[int], bool], max_tokens: int, align: int) -> int:
    """The longest hit, in tokens, at most `max_tokens` and a multiple of `align`, that this group alone
    can serve; `holds(i)` says whether the group holds the request's block i (of spec.block_size)."""
    bs = spec.block_size
    n = max_tokens // bs
    if spec.kind == FULL:
        run = 0
        while run < n and holds(run):
            run += 1
        hit = run * bs
        return hit - hit % align
    if spec.kind == MAMBA:
        for i in range(n - 1, -1, -1):
            if (i + 1) * bs % align == 0 and holds(i):
                return (i + 1) * bs
        return 0
    need = max(1, window_blocks(spec))  # vLLM's scan needs one cached block even for a 1-token window
    run = 0
    for i in range(n - 1, -1, -1):  # right to left: the first run of `need` blocks ending on an aligned edge
        if holds(i):
            if run == 0 and (i + 1) * bs % align:
                continue
            run += 1
            if run >= need:
                return (i + need) * bs
        else:
            run = 0
    # No full window anywhere: a run from block 0 is a hit too (nothing before it to attend to).
    while run and run * bs % align:
        run -= 1
    return run * bs


def longest_hit(groups: Sequence[GroupSpec], holds: Sequence[Callable[[int], bool]], max_tokens: int,
                align: int | None = None) -> tuple[int, int]:
    """vLLM's hit across groups: a fixed point where each group accepts the candidate length or lowers
    it, full-attention groups first. Returns (hit, longest single-group hit seen): their difference is
    vLLM's num_uncached_common_prefix_tokens, a shared prefix a sparse group has not cached yet.
    `max_tokens` is the prompt length - 1; `align` defaults to the scheduler block size."""
    if align is None:
        align = scheduler_block_size(groups)
    order = sorted(range(len(groups)), key=lambda g: groups[g].kind != FULL)
    hit = max(0, max_tokens)
    longest = 0
    while True:
        cur = hit
        for g in order:
            cur = group_longest_hit(groups[g], holds[g], cur, align)
            longest = max(longest, cur)
        if cur >= hit:
            return hit, longest
        hit = cur


def retained_blocks(spec: GroupSpec, start: int, end: int, align: int, retention: int | None,
                    boundaries: Sequence[int]) -> list[bool] | None:
    """Which of the group's newly full blocks [start, end) get a hash (None: all of them), vLLM's
    reachable_block_mask. `retention`: None dense, 0 only the `boundaries` (the prompt's last token,
    prompt length - 1, and a shared-prefix junction), N > 0 also one tail per N-token segment."""
    if spec.kind == FULL or retention is None and spec.kind == MAMBA:
        return None
    bs = spec.block_size
    mask = [False] * (end - start)
    if spec.kind == MAMBA:
        if retention:
            per = retention // bs
            if per <= 1:
                return None
            for i in range(start, end):
                if (i + 1) % per == 0:
                    mask[i - start] = True
        for b in boundaries:
            last = (b // align * align) // bs - 1
            if start <= last < end:
                mask[last - start] = True
        return mask
    need = window_blocks(spec)
    segment = align if retention is None else (retention or None)
    if segment is not None:
        per = segment // bs
        if need >= per:
            return None
        for i in range(start, end):
            if i % per >= per - need:
                mask[i - start] = True
    if retention is not None:
        for b in boundaries:
            edge = (b // align * align) // bs
            for j in range(max(start, edge - need), min(end, edge)):
                mask[j - start] = True
    return mask
