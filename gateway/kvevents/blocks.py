"""What one engine rank holds, rebuilt from its KV events: the set of the gateway's own block keys, plus the map
from the engine's block hashes to them (removals and parents name engine hashes).

What vLLM (0.32) sends beyond SGLang's events, each applied without disturbing the rest:
- a partial prefix-cache block (a `BlockStored` of one hash whose `block_size` is shorter than the page): noted by
  its engine hash so its removal resolves, but given no key (a request is matched on whole pages only);
- the promotion of a partial block to a full one: `BlockRemoved` of the partial hash, then a `BlockStored` of the
  full block under its parent, the ordinary path;
- cached blocks re-announced on a prefix hit, from the sequence's first block with no parent: the same keys are
  computed again (the salt is read from the event), so the view is unchanged.

A block stored under a parent this consumer never saw (the engine cached the parent before this gateway subscribed,
and no replay reached back that far: 0.5.13 names no replay port, and a replay buffer is finite) cannot be keyed
from its own event: a key chains over every token before it. With `adopt` (the request hasher's memory of recent
requests, kvevents/request_keys.py) the run of pages the batch stores from it is looked up in the requests sent; a
request that holds the run right after whole pages gives the parent's key, and the pages before it are held too
(the engine holds a block's ancestors while it holds the block). Without a match it starts a chain of its own
(`orphans`), which no request's chain from the root can match: a conversation that extends a prefix the engine
cached before the gateway joined would never be a prefix hit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.kvevents import keys
from gateway.kvevents.wire import Cleared, Event, Removed, Stored


@dataclass
class Applied:
    """What a batch changed (own keys), so the approximate index can be corrected by the same facts."""

    added: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False


PARTIAL = 0  # the own "key" of a partial block: in by_engine only, never in `held` (own keys are never 0 in practice)
ADOPT_MIN_TOKENS = 16  # a shorter run of new tokens could sit in many requests: not enough to place it
ADOPT_MAX_TOKENS = 4096  # enough to place a run; the rest of the batch's chain follows from the parent's key

# (namespace, the run's token ids, page size) -> the own keys of the pages before the run, or None
Adopter = Callable[[str, Sequence[int], int], list[int] | None]


@dataclass
class RankBlocks:
    page: int = 0  # the engine's page (block) size; 0: each event's block_size is taken as the page
    held: set[int] = field(default_factory=set)
    by_engine: dict[int, int] = field(default_factory=dict)  # engine hash -> own key
    orphans: int = 0  # blocks stored under a parent this consumer never saw (a new chain was started)
    malformed: int = 0  # BlockStored whose token ids do not fill its hashes' pages
    partials: int = 0  # partial prefix-cache blocks seen (vLLM): tracked for removal, never matched
    adopt: Adopter | None = None  # places a block under an unseen parent (above)
    adopted: dict[int, list[int]] = field(default_factory=dict)  # unseen parent's engine hash -> its ancestors' keys
    adoptions: int = 0

    def apply(self, events: list[Event], out: Applied | None = None) -> Applied:
        out = out or Applied()
        for i, ev in enumerate(events):
            if isinstance(ev, Stored):
                self._stored(ev, out, events, i)
            elif isinstance(ev, Removed):
                for h in ev.hashes:
                    k = self.by_engine.pop(h, None)
                    if k is not None and k != PARTIAL:
                        self.held.discard(k)
                        out.removed.append(k)
                    # the ancestors go with it: held on its account only (may be early, never late: leaves go first)
                    for a in self.adopted.pop(h, ()):
                        if a in self.held:
                            self.held.discard(a)
                            out.removed.append(a)
            elif isinstance(ev, Cleared):
                self.clear()
                out.cleared = True
                out.added.clear()
                out.removed.clear()
        return out

    def _stored(self, ev: Stored, out: Applied, events: Sequence[Event] = (), at: int = 0) -> None:
        bs = ev.block_size
        if self.page and 0 < bs < self.page and len(ev.hashes) == 1:
            self.partials += 1
            self.by_engine.setdefault(ev.hashes[0], PARTIAL)
            return
        if bs <= 0 or len(ev.tokens) < len(ev.hashes) * bs:
            self.malformed += 1
            return
        if ev.parent is None:
            prev = keys.seed(keys.namespace(ev.salt, ev.lora))
        else:
            pk = self.by_engine.get(ev.parent)
            if pk is None:
                pk = self._adopt(ev, events, at, out)
            if pk is None or pk == PARTIAL:
                self.orphans += 1
                prev = keys.orphan_seed(ev.parent)
            else:
                prev = keys.to_digest(pk)
        try:
            own = keys.chain(prev, ev.tokens[: len(ev.hashes) * bs], bs)
        except (TypeError, OverflowError):  # a token id that is not a uint32
            self.malformed += 1
            return
        for h, k in zip(ev.hashes, own, strict=False):
            self.by_engine[h] = k
            self.held.add(k)
        out.added.extend(own)

    def _adopt(self, ev: Stored, events: Sequence[Event], at: int, out: Applied) -> int | None:
        """The own key of `ev`'s unseen parent, from a recent request that holds the run of tokens the batch stores
        from `ev` on (its chained BlockStored events; 0.5.13 sends one per page); None when none places it."""
        if self.adopt is None or ev.parent is None:
            return None
        bs = ev.block_size
        run, last = list(ev.tokens[: len(ev.hashes) * bs]), ev.hashes[-1] if ev.hashes else None
        for nxt in events[at + 1:]:
            if len(run) >= ADOPT_MAX_TOKENS or not isinstance(nxt, Stored) or nxt.parent != last \
                    or nxt.block_size != bs or not nxt.hashes:
                break
            run.extend(nxt.tokens[: len(nxt.hashes) * bs])
            last = nxt.hashes[-1]
        if len(run) < ADOPT_MIN_TOKENS:
            return None
        before = self.adopt(keys.namespace(ev.salt, ev.lora), run, bs)
        if not before:
            return None
        self.adoptions += 1
        self.by_engine[ev.parent] = before[-1]
        new = [k for k in before if k not in self.held]
        self.adopted[ev.parent] = [k for k in new if k != before[-1]]  # not those held on their own events' account
        self.held.update(new)
        out.added.extend(new)
        return before[-1]

    def clear(self) -> None:
        self.held.clear()
        self.by_engine.clear()
        self.adopted.clear()

    def __len__(self) -> int:
        return len(self.held)
