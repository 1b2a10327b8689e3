"""`char-tree`: the routing benchmark's strongest guessing baseline, SGLang's model gateway
`cache_aware` policy with its published defaults (written here from reading its source for the
rules, sgl-project/sglang `sgl-router/src/policies/cache_aware.rs` and `tree.rs`; not its code).

The gateway never sees the engines' caches. Per gateway replica (per model) it keeps one
approximate radix tree over the text of the requests it routed, shared by all workers: each node
records which workers ("tenants") were sent text through it and when (`tree.rs` `Tree`,
`Node.tenant_last_access_time`), and each worker's size is the characters of the nodes it is on
(`Tree.tenant_char_count`). Every worker starts in it with the empty text
(`CacheAwarePolicy::init_workers` / `add_worker` insert ""), so an unused worker has size 0.
For each request (`CacheAwarePolicy::select_worker`):

1. load override: the loads are the gateway's own in-flight requests per worker (incremented at
   dispatch, decremented when the response ends: `WorkerLoadGuard`; per replica, nothing shared).
   If max - min > `balance_abs_threshold` (64) AND max > `balance_rel_threshold` (1.5) x min,
   the least loaded worker (the first in the worker list on ties: Rust's `min_by_key`); the
   request's text is still inserted under that worker;
2. else `Tree::prefix_match`: the longest prefix of the text in the tree (over every worker)
   and the first worker recorded on the deepest node reached (the first key of that node's
   map: an arbitrary order, fixed per node; here each node gets a seeded order, so runs are
   deterministic); it also marks that worker's path used now. Match rate = matched characters /
   characters of the text; if it is > `cache_threshold` (0.3, strictly), that worker;
3. else `Tree::get_smallest_tenant`: the worker with the fewest characters (ties: the first in
   the tree's worker map, again a seeded order here): new text goes where the least is cached.
The chosen worker then gets the text inserted (`Tree::insert`: every node on the path marked
with it and the time, its size grown by the nodes it was not on yet).

Eviction (`CacheAwarePolicy::with_config`'s thread, `Tree::evict_tenant_by_size`): every
`eviction_interval_secs` (120 s in the gateway's CLI defaults; 60 s in some launchers' logs),
for each worker whose size exceeds `max_tree_size` (2**26 = 67,108,864 characters), its least
recently used leaves (nodes it is on and none of whose children it is on) are taken off it,
oldest first, a parent becoming a leaf joining the queue, until it fits; a node no worker is on
any more is removed. The bench runs those passes on its virtual clock, at the first pick at or
after each due time (between picks the tree is not read, so that is the same). Within a run (tens
of virtual seconds, a few MB of text per worker) neither the interval nor the size is reached:
the tree remembers everything it sent, including what the engine has long evicted or flushed,
as the real one does.

Text: the bench's requests are token ids and have no text. SGLang's gateway turns a request of
token ids into text the same way (`GenerateRequest::extract_text_for_routing`: the ids in
decimal joined by spaces), so that is the text here (`request_text`), matched in characters as
the gateway does (~6 characters a token for the bench's 4-5-digit ids; different ids may share
leading digits, as words share letters). For chat requests the real gateway uses the messages'
text; the match ratios of equal prefixes are the same either way.

One instance per gateway replica: each learns only from its own decisions and counts only its own
requests in flight, as separate gateway processes do.
"""
from __future__ import annotations

import heapq
import random
import zlib
from typing import Iterable, Mapping, Sequence

DEFAULT_CACHE_THRESHOLD = 0.3
DEFAULT_BALANCE_ABS_THRESHOLD = 64
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
DEFAULT_EVICTION_INTERVAL_S = 120.0
DEFAULT_MAX_TREE_SIZE = 2 ** 26  # characters per worker


def request_text(token_ids: Sequence[int]) -> str:
    """The text SGLang's gateway routes a token-id request on: the ids in decimal, space-separated."""
    return " ".join(map(str, token_ids))


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
    __slots__ = ("label", "parent", "children", "tenants", "order")

    def __init__(self, label: str, parent: "_Node | None", order: int) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}  # worker -> last access (virtual s)
        self.order = order  # this node's arbitrary but fixed order of its workers (its map's hasher)

    def first_tenant(self) -> str | None:
        return min(self.tenants, key=lambda t: _rank(self.order, t)) if self.tenants else None

    def leaf_of(self) -> set[str]:
        """The workers this node is a leaf for: on it, on none of its children."""
        out = set(self.tenants)
        for child in self.children.values():
            out.difference_update(child.tenants)
        return out


def _rank(order: int, tenant: str) -> int:
    return zlib.crc32(f"{order}:{tenant}".encode())


class TenantTree:
    """SGLang's multi-worker radix tree over characters (see the module docstring)."""

    def __init__(self, seed: str | int = 0) -> None:
        self._rng = random.Random(f"tenant-tree:{seed}")
        self._root = _Node("", None, self._rng.getrandbits(32))
        self._order = self._rng.getrandbits(32)  # the order of tenant_chars' keys
        self.tenant_chars: dict[str, int] = {}  # worker -> characters of the nodes it is on

    def insert(self, text: str, tenant: str, now: float) -> None:
        """Record `text` as sent to `tenant` at `now`: every node on its path marked with it."""
        node = self._root
        node.tenants[tenant] = now
        self.tenant_chars.setdefault(tenant, 0)
        i, n = 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, self._rng.getrandbits(32))
                leaf.tenants[tenant] = now
                node.children[text[i]] = leaf
                self.tenant_chars[tenant] += n - i
                return
            label = child.label
            k = len(label) if text.startswith(label, i) else _common(label, text, i)
            if k < len(label):  # split the edge at k; the upper part keeps the node's workers and order
                upper = _Node(label[:k], node, child.order)
                upper.tenants = dict(child.tenants)
                node.children[text[i]] = upper
                child.label = label[k:]
                child.parent = upper
                upper.children[child.label[0]] = child
                child = upper
            if tenant not in child.tenants:
                self.tenant_chars[tenant] += len(child.label)
            child.tenants[tenant] = now
            i += k
            node = child

    def prefix_match(self, text: str, now: float) -> tuple[int, str | None]:
        """(characters of `text`'s longest prefix in the tree, the first worker on the deepest node
        reached); that worker's path is marked used at `now`."""
        node, i, n = self._root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            label = child.label
            k = len(label) if text.startswith(label, i) else _common(label, text, i)
            i += k
            node = child
            if k < len(label):
                break
        tenant = node.first_tenant()
        if tenant is not None:
            up: _Node | None = node
            while up is not None:
                up.tenants[tenant] = now
                up = up.parent
        return i, tenant

    def smallest_tenant(self) -> str | None:
        """The worker with the fewest characters (ties: the first in this tree's worker order)."""
        if not self.tenant_chars:
            return None
        return min(self.tenant_chars, key=lambda t: (self.tenant_chars[t], _rank(self._order, t)))

    def evict(self, max_size: int) -> None:
        """Take each worker over `max_size` characters off its least recently used leaves until it fits."""
        heap: list[tuple[float, int, str, _Node]] = []
        seq = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for t in node.leaf_of():
                heap.append((node.tenants[t], seq, t, node))
                seq += 1
        heapq.heapify(heap)
        while heap:
            _, _, t, node = heapq.heappop(heap)
            if self.tenant_chars.get(t, 0) <= max_size:
                continue
            if t in node.tenants:
                self.tenant_chars[t] = max(0, self.tenant_chars[t] - len(node.label))
                del node.tenants[t]
            parent = node.parent
            if parent is None:
                continue
            if not node.children and not node.tenants:
                del parent.children[node.label[0]]
            if t in parent.leaf_of():
                heapq.heappush(heap, (parent.tenants[t], seq, t, parent))
                seq += 1

    def remove_tenant(self, tenant: str) -> None:
        """Take `tenant` off every node (a worker removed); nodes left with no worker go."""
        def walk(node: _Node) -> None:
            for child in list(node.children.values()):
                walk(child)
                if not child.children and not child.tenants:
                    del node.children[child.label[0]]
            node.tenants.pop(tenant, None)
        walk(self._root)
        self.tenant_chars.pop(tenant, None)

    def sizes(self) -> dict[str, int]:
        """Each worker's characters counted over the nodes (what tenant_chars maintains)."""
        out: dict[str, int] = {}
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for t in node.tenants:
                out[t] = out.get(t, 0) + len(node.label)
        return out

    def match(self, text: str) -> int:
        """Characters of `text`'s longest prefix in the tree (changes nothing)."""
        node, i, n = self._root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common(child.label, text, i)
            i += k
            if k < len(child.label):
                break
            node = child
        return i


class CharTreePolicy:
    """One gateway replica's `cache_aware` decisions (see the module docstring)."""

    def __init__(self, pods: Iterable[str], seed: str | int = 0, *,
                 cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
                 balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
                 eviction_interval_s: float = DEFAULT_EVICTION_INTERVAL_S,
                 max_tree_size: int = DEFAULT_MAX_TREE_SIZE, now: float = 0.0) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.tree = TenantTree(seed)
        self.workers: list[str] = []  # the gateway's worker list, in order
        self._next_eviction = now + eviction_interval_s
        for p in pods:
            self.add_pod(p, now)

    def add_pod(self, pod: str, now: float = 0.0) -> None:
        if pod not in self.workers:
            self.workers.append(pod)
            self.tree.insert("", pod, now)

    def remove_pod(self, pod: str) -> None:
        if pod in self.workers:
            self.workers.remove(pod)
        self.tree.remove_tenant(pod)

    def _evict_due(self, now: float) -> None:
        if self.eviction_interval_s <= 0 or now < self._next_eviction:
            return
        self.tree.evict(self.max_tree_size)  # passes with no insert between them change nothing more
        passes = int((now - self._next_eviction) // self.eviction_interval_s) + 1
        self._next_eviction += passes * self.eviction_interval_s

    def choose(self, text: str, loads: Mapping[str, int], now: float = 0.0) -> tuple[str, str]:
        """(pod, why) for a request's text: select_worker without the final insert; why is
        imbalance | match | smallest. Marks the matched worker's path used, as prefix_match does."""
        self._evict_due(now)
        counts = [loads.get(p, 0) for p in self.workers]
        hi, lo = max(counts), min(counts)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self.workers[counts.index(lo)], "imbalance"
        matched, tenant = self.tree.prefix_match(text, now)
        rate = matched / len(text) if text else 0.0
        selected, why = (tenant, "match") if rate > self.cache_threshold else (self.tree.smallest_tenant(), "smallest")
        if selected is None or selected not in self.workers:  # a worker that left: dropped; the first worker
            if selected is not None:
                self.tree.remove_tenant(selected)
            return self.workers[0], "fallback"
        return selected, why

    def pick(self, token_ids: Sequence[int], loads: Mapping[str, int], now: float = 0.0) -> str:
        """The pod for a request, its text inserted under that pod."""
        text = request_text(token_ids)
        pod, _ = self.choose(text, loads, now)
        self.tree.insert(text, pod, now)
        return pod
