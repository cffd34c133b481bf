"""What one engine rank holds, rebuilt from its KV events: the set of the gateway's own block keys, plus the map
from the engine's block hashes to them (removals and parents name engine hashes).

What vLLM (0.32) sends beyond SGLang's events, each applied without disturbing the rest:
- a partial prefix-cache block (a `BlockStored` of one hash whose `block_size` is shorter than the page): noted by
  its engine hash so its removal resolves, but given no key (a request is matched on whole pages only);
- the promotion of a partial block to a full one: `BlockRemoved` of the partial hash, then a `BlockStored` of the
  full block under its parent, the ordinary path;
- cached blocks re-announced on a prefix hit, from the sequence's first block with no parent: the same keys are
  computed again (the salt is read from the event), so the view is unchanged.
"""

from __future__ import annotations

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


@dataclass
class RankBlocks:
    page: int = 0  # the engine's page (block) size; 0: each event's block_size is taken as the page
    held: set[int] = field(default_factory=set)
    by_engine: dict[int, int] = field(default_factory=dict)  # engine hash -> own key
    orphans: int = 0  # blocks stored under a parent this consumer never saw (a new chain was started)
    malformed: int = 0  # BlockStored whose token ids do not fill its hashes' pages
    partials: int = 0  # partial prefix-cache blocks seen (vLLM): tracked for removal, never matched

    def apply(self, events: list[Event], out: Applied | None = None) -> Applied:
        out = out or Applied()
        for ev in events:
            if isinstance(ev, Stored):
                self._stored(ev, out)
            elif isinstance(ev, Removed):
                for h in ev.hashes:
                    k = self.by_engine.pop(h, None)
                    if k is not None and k != PARTIAL:
                        self.held.discard(k)
                        out.removed.append(k)
            elif isinstance(ev, Cleared):
                self.clear()
                out.cleared = True
                out.added.clear()
                out.removed.clear()
        return out

    def _stored(self, ev: Stored, out: Applied) -> None:
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

    def clear(self) -> None:
        self.held.clear()
        self.by_engine.clear()

    def __len__(self) -> int:
        return len(self.held)
