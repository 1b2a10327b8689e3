"""The prompts of this gateway's running requests, per pod: what each pod holds or is about to.

The event-fed index learns a prompt's blocks once its engine has computed them, a queue and a prefill after the
pick (under load hundreds of milliseconds, seconds where KV is short). Until then the pod a tenant's first
request went to looks like any other to its second: a burst of one tenant's conversations spreads over every
engine, each prefilling a copy of the tenant's system prompt, and where KV is short each copy evicts another
tenant's. A running request's blocks stay in its engine until it ends (vLLM frees them only by preempting it),
so while it runs its pod holds, or is prefilling, its prompt's full blocks; unless its engine's cache is cleared
meanwhile (reset_prefix_cache, a restart): a running request's blocks then stay with it, but no other request
can hit them, so a pod's claims end at the index's next count of its clears (`clears`).

This gateway's requests, and with a `listener` and `peer_added`/`peer_moved`/`peer_removed` the other replicas'
(routing.state.prompt_relay carries them through Redis): a tenant's burst dealt over two replicas is one burst.
A prompt whose pod already holds all but its last UNTOLD_BLOCKS full blocks (the index's count at the pick: a
cached system prompt or history, and this request's own question) is counted here and not told: the others see
what it shares in the index already, and a request sharing its few new blocks could gain as many blocks' credit
(two blocks: 32 tokens of prefill), while each message told wakes Redis and every replica. The listener hears
"keep" for it instead, and nothing of its end; if it moves to a fallback, it is told then.
Only plain prompts of a model of one KV cache group: a salted or multimodal prompt's blocks hash more than its
tokens, and a hybrid model's hit is its groups' fixed point (kvcache.groups), neither of which a prompt's tokens
alone answer.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable, Protocol, Sequence

from kvcache.blockkeys import BlockExtras, block_keys

UNTOLD_BLOCKS = 2  # a prompt adding at most this many full blocks to what its pod holds is not told (see above)


class ClaimSource(Protocol):
    """What RunningPrompts reads of the index (kvcache.index.PrefixIndex, kvcache.locking.LockedIndex)."""

    def block_size(self, model: str) -> int | None: ...

    def clears(self, pod: str, rank: int = 0) -> int: ...

    def single_group(self, model: str) -> bool: ...


class _Held:
    """One target's running prompts' block keys, counted in bulk: a prompt's keys go into `added` at its start
    and into `gone` at its end, each a Counter updated in C (Counter.update of a list), where a loop over a
    prompt's keys in Python cost a pick and a release ~10 us each for a 1,200-token prompt (bench request). A
    key is held while added[key] > gone[key]; once as many prompts ended as run (at least REBUILD), `added` is
    counted again from the running prompts' keys and `gone` emptied."""

    __slots__ = ("epoch", "added", "gone", "live", "ended")
    REBUILD = 8

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch  # its engine's clear count when these were counted
        self.added: Counter[int] = Counter()
        self.gone: Counter[int] = Counter()
        self.live = 0  # prompts counted and not ended
        self.ended = 0  # prompts in `gone`

    def holds(self, key: int) -> bool:
        n = self.added.get(key)
        return n is not None and (not self.gone or n > self.gone.get(key, 0))


class RunningPrompts:
    """Per target (a pod, or a data-parallel rank `<pod>#<rank>`), the block keys of the prompts of the requests
    `add`ed to it and not yet `remove`d, counted while the target's engine has not been cleared since."""

    def __init__(self, index: ClaimSource, max_blocks: int = 8192) -> None:
        self._index = index
        self._max_blocks = max_blocks  # a prompt's keys counted at most (a 128k-token prompt of 16-token blocks)
        # target -> its running prompts' keys, counted while its engine's clear count is theirs. A key is its
        # whole prefix's (chained), so a target holding a prompt's block i holds the ones before.
        self._held: dict[str, _Held] = {}
        # ticket (this gateway's int, or a peer's (gateway, ticket)) -> (target, clear count, keys)
        self._running: dict[Hashable, tuple[str, int, list[int]]] = {}
        self._untold: set[int] = set()  # this gateway's tickets the listener heard "keep" of
        # told of each of this gateway's changes (the relay to the other replicas): ["add", ticket, target, pod,
        # rank, keys], ["move", ticket, target, pod, rank], ["end", ticket], ["keep", ticket] (not to be sent)
        self.listener: Callable[[list], None] | None = None
        # the last prompt's keys (the pick's held() then add() ask for the same prompt): its token list, model,
        # adapter and extras, by identity, then the keys
        self._last: tuple[object, str, str | None, object, list[int] | None] = (None, "", None, None, None)

    def __len__(self) -> int:
        """Requests whose prompts are counted."""
        return len(self._running)

    def held(self, model: str, lora: str | None, token_ids: Sequence[int] | None, extras: BlockExtras | None,
             targets: Iterable[tuple[str, str, int]]) -> dict[str, int]:
        """Per target (name, pod, rank) where some running prompt begins as this one: how many of this
        prompt's leading full blocks they hold. {} where none does, or the prompt is not a plain one."""
        if not self._held or not token_ids:
            return {}
        keys = self._keys(model, lora, token_ids, extras)
        if not keys:
            return {}
        first, out = keys[0], {}
        clears = self._index.clears
        for name, pod, rank in targets:
            entry = self._held.get(name)
            if entry is None or entry.epoch != clears(pod, rank):
                continue
            holds = entry.holds
            if not holds(first):
                continue
            lo, hi = 1, len(keys)  # keys[:lo] held, keys[hi:] not: the leading run by bisection
            while lo < hi:
                mid = (lo + hi) // 2
                if holds(keys[mid]):
                    lo = mid + 1
                else:
                    hi = mid
            out[name] = lo
        return out

    def add(self, ticket: int, target: str, pod: str, rank: int, model: str, lora: str | None,
            token_ids: Sequence[int] | None, extras: BlockExtras | None, held: int | None = None) -> None:
        """Request `ticket` runs on `target` (of `pod`, `rank`). `held`: the prompt's leading full blocks the
        target holds per the index (None: not looked up), for what the listener is told (see the module)."""
        keys = self._keys(model, lora, token_ids, extras) if token_ids else None
        if keys:
            self.peer_added(ticket, target, pod, rank, keys)
            if self.listener is not None:
                if held is not None and len(keys) - held <= UNTOLD_BLOCKS:
                    self._untold.add(ticket)
                    self.listener(["keep", ticket])
                else:
                    self.listener(["add", ticket, target, pod, rank, keys])

    def moved(self, ticket: int, target: str, pod: str, rank: int) -> None:
        """Request `ticket` runs on `target` after all (the data plane's fallback served it): a kept prompt is
        told now, whole (what the fallback holds of it is not known)."""
        if not self.peer_moved(ticket, target, pod, rank) or self.listener is None:
            return
        if ticket in self._untold:
            self._untold.discard(ticket)
            self.listener(["add", ticket, target, pod, rank, self._running[ticket][2]])
        else:
            self.listener(["move", ticket, target, pod, rank])

    def remove(self, ticket: int) -> None:
        """Request `ticket` ended (idempotent)."""
        told = ticket not in self._untold
        self._untold.discard(ticket)
        if self.peer_removed(ticket) and told and self.listener is not None:
            self.listener(["end", ticket])

    # Another replica's request (`ticket`: (its gateway, its ticket)), or this gateway's once its keys are known;
    # nobody is told.

    def peer_added(self, ticket: Hashable, target: str, pod: str, rank: int, keys: list[int]) -> None:
        self.peer_removed(ticket)  # a restarted peer numbers its tickets again
        epoch = self._index.clears(pod, rank)
        self._running[ticket] = (target, epoch, keys)
        self._count(target, epoch, keys, 1)

    def peer_moved(self, ticket: Hashable, target: str, pod: str, rank: int) -> bool:
        entry = self._running.get(ticket)
        if entry is None or entry[0] == target:
            return False
        self.peer_removed(ticket)
        epoch = self._index.clears(pod, rank)
        self._running[ticket] = (target, epoch, entry[2])
        self._count(target, epoch, entry[2], 1)
        return True

    def peer_removed(self, ticket: Hashable) -> bool:
        entry = self._running.pop(ticket, None)
        if entry is None:
            return False
        self._count(*entry, -1)
        return True

    def _keys(self, model: str, lora: str | None, token_ids: Sequence[int],
              extras: BlockExtras | None) -> list[int] | None:
        """The prompt's full blocks' keys, or None where its tokens do not answer (see the module)."""
        last = self._last
        if last[0] is token_ids and last[1] == model and last[2] == lora and last[3] is extras:
            return last[4]
        keys = None
        if extras is None and self._index.single_group(model):
            bs = self._index.block_size(model)
            if bs:
                keys = block_keys(model, lora, token_ids[:bs * self._max_blocks], bs)
        self._last = (token_ids, model, lora, extras, keys)
        return keys

    def _count(self, target: str, epoch: int, keys: list[int], step: int) -> None:
        entry = self._held.get(target)
        if entry is None or entry.epoch != epoch:
            if step < 0:
                return  # counted before a clear that has since emptied the target's counts
            if entry is not None and entry.epoch > epoch:
                return  # an add raced past by a clear: nothing to claim
            entry = self._held[target] = _Held(epoch)
        if step > 0:
            entry.added.update(keys)
            entry.live += 1
            return
        entry.live -= 1
        if entry.live <= 0:  # kept, emptied: one request at a time would make a pair of Counters per request
            entry.added.clear()
            entry.gone.clear()
            entry.live = entry.ended = 0
            return
        entry.gone.update(keys)
        entry.ended += 1
        if entry.ended >= entry.live and entry.ended >= _Held.REBUILD:
            added: Counter[int] = Counter()
            for t, e, k in self._running.values():
                if t == target and e == epoch:
                    added.update(k)
            entry.added, entry.gone, entry.ended = added, Counter(), 0

