"""KV cache groups: what each kind of group needs for a prefix cache hit, and the hit an engine
computes over all of a model's groups.

A model's layers of one attention kind share a KV cache group (vLLM's kv_cache_planning); each
group has its own block size, and one chain of block hashes serves every group. A hit of h tokens
needs, in every group (vLLM 0.33, v1/core/kv_cache_coordinator.py and single_type_kv_cache_manager.py):
- full attention (and MLA, sink full attention): every block of [0, h);
- sliding window w: the cdiv(w - 1, block) blocks ending at h, or, failing any such run, a run
  of held blocks from block 0 (its length is then the hit);
- mamba (state): the block ending at h.
The engine starts from the prompt length - 1, rounded down to the alignment (the least common
multiple of the groups' block sizes), asks the full-attention groups first and then the others, each
within the hit the previous ones left, and repeats until a pass changes nothing. A window or state
group's run must also end on the alignment.
A kind kvgate does not model gets the full-attention rule: it needs every block from block 0, which
is never less than what such a group needs (the answer can only be below the engine's, never above).

Positions are in units (the greatest common divisor of the model's block sizes): bit p of a holder bitmap says
the unit block p (tokens [p * unit, (p + 1) * unit)) is held; a group block of r units is held when
its last unit is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from math import gcd
from typing import Sequence

log = logging.getLogger(__name__)

FULL_KINDS = frozenset(("full_attention", "mla_attention", "sink_full_attention"))
WINDOW_KINDS = frozenset(("sliding_window", "sliding_window_mla"))
STATE_KINDS = frozenset(("mamba",))

FULL, WINDOW, STATE = "full", "window", "state"


@dataclass(slots=True)
class Group:
    """One KV cache group of a model, as its events describe it."""
    index: int
    kind: str | None  # kv_cache_spec_kind (vLLM 0.22+); None: not said
    block_size: int
    window: int | None = None  # tokens, for sliding-window kinds
    rule: str = FULL
    modelled: bool = True  # False: a kind (or a missing kind beside other groups) given the full rule

    def describe(self) -> dict:
        return {"kind": self.kind, "block_size": self.block_size, "sliding_window": self.window,
                "rule": self.rule, "modelled": self.modelled}


def rule_of(index: int, kind: str | None, window: int | None) -> tuple[str, bool]:
    """(hit rule, whether the kind is modelled) of a group. Group 0 without a kind is the one group of a
    model before vLLM 0.20 (or of a dense model since): full attention."""
    if kind is None:
        return FULL, index == 0
    if kind in FULL_KINDS:
        return FULL, True
    if kind in WINDOW_KINDS:
        if type(window) is int and window > 0:
            return WINDOW, True
        return FULL, False  # a window kind without its window: needs every block
    if kind in STATE_KINDS:
        return STATE, True
    return FULL, False


@dataclass(slots=True)
class Shape:
    """A model's KV cache groups as learnt from its events."""
    groups: dict[int, Group] = field(default_factory=dict)
    unit: int = 0  # the greatest common divisor of the block sizes: the granularity of kvgate's keys
    align: int = 0  # the least common multiple of the block sizes: hits land on it

    @property
    def simple(self) -> bool:
        """One group, full attention, group 0: the shape the native fast path serves."""
        if len(self.groups) != 1:
            return False
        g = self.groups.get(0)
        return g is not None and g.rule == FULL and g.modelled

    @property
    def exact(self) -> bool:
        return all(g.modelled for g in self.groups.values())

    def learn(self, index: int, kind: str | None, window: int | None, block_size: int) -> tuple[Group, bool]:
        """The group `index` as this event describes it; True when that changed what was known."""
        g = self.groups.get(index)
        if g is not None and g.block_size == block_size and (kind is None or g.kind == kind) and \
                (window is None or g.window == window):
            return g, False
        if g is not None:
            kind = kind if kind is not None else g.kind
            window = window if window is not None else g.window
        rule, modelled = rule_of(index, kind, window)
        g = self.groups[index] = Group(index, kind, block_size, window, rule, modelled)
        g0 = self.groups.get(0)
        if g0 is not None and g0.kind is None and len(self.groups) > 1:
            g0.modelled = False  # several groups (vLLM 0.20-0.21 said no kinds): group 0's rule is a guess
        sizes = [x.block_size for x in self.groups.values()]
        unit = align = sizes[0]
        for s in sizes[1:]:
            unit = gcd(unit, s)
            align = align * s // gcd(align, s)
        self.unit, self.align = unit, align
        return g, True


def group_hit(group: Group, held: int, limit: int, unit: int, align: int) -> int:
    """The longest hit, in tokens, at most `limit`, that `group` allows given `held` (a bitmap of unit
    blocks the candidate holds in this group)."""
    bs = group.block_size
    r = bs // unit
    nb = limit // bs
    if r != 1:  # the group's block j is held when its last unit, r * (j + 1) - 1, is
        blocks = 0
        for j in range(nb):
            if held >> (r * (j + 1) - 1) & 1:
                blocks |= 1 << j
        held = blocks
    else:
        held &= (1 << nb) - 1
    if group.rule == FULL:
        run = (~held & (held + 1)).bit_length() - 1  # leading held blocks
        return run * bs // align * align
    if group.rule == STATE:
        for j in range(nb - 1, -1, -1):
            if held >> j & 1 and (j + 1) * bs % align == 0:
                return (j + 1) * bs
        return 0
    need = max(1, -(-(group.window - 1) // bs))  # type: ignore[operator]  # WINDOW: window is set
    # (vLLM's scan needs one cached block even for a window of one token)
    run = 0
    for j in range(nb - 1, -1, -1):
        if held >> j & 1:
            run += 1
            if run >= need and (j + need) * bs % align == 0:
                return (j + need) * bs
        else:
            run = 0
    return run * bs // align * align  # the run from block 0, shorter than the window


def longest_hit(groups: Sequence[Group], held: Sequence[int], n_tokens: int, unit: int, align: int) -> int:
    """The prefix hit, in tokens, of a prompt of `n_tokens` on a candidate holding held[i] (unit-block
    bitmap) in groups[i]: the fixed point described above."""
    if n_tokens <= 1 or not groups:
        return 0
    hit = (n_tokens - 1) // align * align
    order = sorted(range(len(groups)), key=lambda i: (groups[i].rule != FULL, groups[i].index))
    while hit > 0:
        new = hit
        for i in order:
            new = min(new, group_hit(groups[i], held[i], new, unit, align))
            if not new:
                return 0
        if new == hit:
            return hit
        hit = new
    return 0
