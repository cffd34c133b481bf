"""What one engine rank holds, rebuilt from its KV events: the set of the gateway's own block keys, plus the map
from the engine's block hashes to them (removals and parents name engine hashes)."""

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


@dataclass
class RankBlocks:
    held: set[int] = field(default_factory=set)
    by_engine: dict[int, int] = field(default_factory=dict)  # engine hash -> own key
    orphans: int = 0  # blocks stored under a parent this consumer never saw (a new chain was started)
    malformed: int = 0  # BlockStored whose token ids do not fill its hashes' pages

    def apply(self, events: list[Event], out: Applied | None = None) -> Applied:
        out = out or Applied()
        for ev in events:
            if isinstance(ev, Stored):
                self._stored(ev, out)
            elif isinstance(ev, Removed):
                for h in ev.hashes:
                    k = self.by_engine.pop(h, None)
                    if k is not None:
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
        if bs <= 0 or len(ev.tokens) < len(ev.hashes) * bs:
            self.malformed += 1
            return
        if ev.parent is None:
            prev = keys.seed(keys.namespace(ev.salt, ev.lora))
        else:
            pk = self.by_engine.get(ev.parent)
            if pk is None:
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
