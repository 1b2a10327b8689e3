"""`char-tree`: the routing benchmark's strongest guessing baseline, after the published design of
SGLang's model gateway `cache_aware` policy (written here from its description, not its code).

The gateway never sees the engines' caches. It keeps, per engine, a radix tree over the text of
the requests it sent there, and for each request:

1. load-imbalance override: if max - min of the engines' running requests > `abs_imbalance` (64)
   and max > `rel_imbalance` (1.5) x min, the engine with the fewest running requests;
2. else the match ratio = characters of the request matched by the engine tree that matches the
   longest prefix / characters of the request; if it is >= `threshold` (0.3), that engine;
3. else the engine with the smallest tree (fewest characters): new text goes where there is
   the least cached.

The chosen engine's tree then gets the request's text inserted (in every case). Ties (equal
matches, equal tree sizes, equal loads) are broken by a seeded random choice, deterministic per
run; the real gateway breaks them by map order, equally blind.

Each tree is bounded by `max_chars` characters: past it, least recently used leaves (a leaf's
time is that of the last insert through it) are removed until the tree fits. The gateway's
defaults in the versions with the thresholds above (0.3, 64, 1.5) are a maximum tree size of
2**26 characters per worker, enforced by an eviction pass every 120 s: a memory bound for the
router, hundreds of times what an engine's KV cache holds, not a model of it. The bench uses
the same 2**26 (67 M characters: 16.8 M tokens at 4 characters a token, against a simulated
engine's ~30-110 k tokens) and evicts at insert time instead of on a timer; within a run (tens
of virtual seconds) neither ever evicts, so the tree remembers everything it sent, including
what the engine has long evicted or flushed, as the real one does between its passes.

Text: the bench's requests are token ids, so each id maps to a fixed 4-character string
(base 64 of its low 24 bits): equal token prefixes are equal text prefixes, and different
tokens may share leading characters, as words do.

One instance per gateway replica: each learns only from its own decisions. Running counts are
the shared ones every policy sees (Redis-shared counts in kvgate, the gateway's own load
counters in SGLang's).
"""
from __future__ import annotations

import heapq
import random
from typing import Iterable, Mapping, Sequence

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-_"
_PAIRS = tuple(a + b for a in _ALPHABET for b in _ALPHABET)  # 4096 two-character strings
CHARS_PER_TOKEN = 4
DEFAULT_MAX_CHARS = 2 ** 26


def token_text(token_ids: Sequence[int]) -> str:
    """Each token id as 4 characters (its low 24 bits in base 64): one character string per prompt."""
    pairs = _PAIRS
    return "".join([pairs[(t >> 12) & 0xFFF] + pairs[t & 0xFFF] for t in token_ids])


def _common(label: str, text: str, at: int) -> int:
    """Length of the common prefix of `label` and `text[at:]` (binary search on slices)."""
    n = min(len(label), len(text) - at)
    if text.startswith(label[:n], at):
        return n
    lo, hi = 0, n  # label[:lo] matches, label[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(label[:mid], at):
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("label", "parent", "children", "last")

    def __init__(self, label: str, parent: "_Node | None", last: int) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last = last


class CharTree:
    """A radix tree over characters, bounded to `max_chars` characters by LRU leaf eviction."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be >= 1")
        self.max_chars = max_chars
        self._root = _Node("", None, 0)
        self._tick = 0
        self.size = 0  # characters stored (sum of the edge labels)

    def match(self, text: str) -> int:
        """Characters of `text`'s longest prefix present in the tree (changes nothing)."""
        node, i, n = self._root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            label = child.label
            if text.startswith(label, i):
                i += len(label)
                node = child
                continue
            return i + _common(label, text, i)
        return i

    def insert(self, text: str) -> None:
        """Add `text`, mark its path most recently used, then evict down to the bound."""
        self._tick += 1
        tick = self._tick
        node, i, n = self._root, 0, len(text)
        node.last = tick
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                node.children[text[i]] = _Node(text[i:], node, tick)
                self.size += n - i
                break
            label = child.label
            k = len(label) if text.startswith(label, i) else _common(label, text, i)
            if k < len(label):  # split the edge at k
                mid = _Node(label[:k], node, tick)
                node.children[text[i]] = mid
                child.label = label[k:]
                child.parent = mid
                mid.children[child.label[0]] = child
                child = mid
            child.last = tick
            i += k
            node = child
        if self.size > self.max_chars:
            self._evict()

    def _evict(self) -> None:
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last, id(node), node))
        heapq.heapify(heap)
        while self.size > self.max_chars and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None  # a leaf, never the root
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            if not parent.children and parent is not self._root:
                heapq.heappush(heap, (parent.last, id(parent), parent))

    def __contains__(self, text: str) -> bool:
        return self.match(text) == len(text)


class CharTreePolicy:
    """One gateway replica's `char-tree` decisions (see the module docstring)."""

    def __init__(self, pods: Iterable[str], rng: random.Random, *, threshold: float = 0.3,
                 abs_imbalance: int = 64, rel_imbalance: float = 1.5, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self._rng = rng
        self.threshold = threshold
        self.abs_imbalance = abs_imbalance
        self.rel_imbalance = rel_imbalance
        self._max_chars = max_chars
        self.trees: dict[str, CharTree] = {}
        for p in pods:
            self.add_pod(p)

    def add_pod(self, pod: str) -> None:
        self.trees.setdefault(pod, CharTree(self._max_chars))

    def remove_pod(self, pod: str) -> None:
        self.trees.pop(pod, None)

    def _pick_min(self, values: Mapping[str, float]) -> str:
        least = min(values.values())
        tied = [p for p, v in values.items() if v == least]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def choose(self, text: str, running: Mapping[str, int]) -> tuple[str, str]:
        """(pod, why) for a request's text, without recording it; why is imbalance | match | smallest."""
        loads = {p: running.get(p, 0) for p in self.trees}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.abs_imbalance and hi > self.rel_imbalance * lo:
            return self._pick_min(loads), "imbalance"
        matched = {p: t.match(text) for p, t in self.trees.items()}
        best = max(matched.values())
        if text and best / len(text) >= self.threshold:
            return self._pick_min({p: -m for p, m in matched.items()}), "match"
        return self._pick_min({p: t.size for p, t in self.trees.items()}), "smallest"

    def pick(self, token_ids: Sequence[int], running: Mapping[str, int]) -> str:
        """The pod for a request, its text inserted into that pod's tree."""
        text = token_text(token_ids)
        pod, _ = self.choose(text, running)
        self.trees[pod].insert(text)
        return pod
