"""The Wafer workload in token space, for the virtual-clock fleets: shared-prefix groups (12k tokens each) and a
Poisson stream of 20k-token prompts (a group's prefix + 8k new tokens, 1k output tokens).

One generator serves the unified fleet (`fleet_wafer.run_fleet`) and the PD replay (`replay/pd.wafer_arrivals`), so
the two measure the same workload. The draw order (prefixes, then per arrival: gap, group, tail tokens, tail hashes)
is part of the contract: a seed names one sequence of requests.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from gateway.prefix.hashing import chain, group_key
from gateway.routing.request import RoutingRequest
from gateway_lab.sim.fleet import Job

PREFIX_TOKENS = 12_000
PROMPT_TOKENS = 20_000
OUTPUT_TOKENS = 1_000
VOCAB = 150_000
_SEED_BYTES = b"glm-5.2\x00tenant"  # the chain's seed for tenant "tenant" on model "glm-5.2"

PageKeys = Callable[[np.ndarray, str], list[int]]


class WaferGroups:
    """`n_groups` prefixes drawn from `seed`, their routing hashes at `chunk` tokens, and the arrivals over them."""

    def __init__(self, n_groups: int, chunk: int, seed: int = 0) -> None:
        self.chunk = chunk
        self.rng = random.Random(seed)
        self.nrng = np.random.default_rng(seed)
        self.prefixes = [self.nrng.integers(0, VOCAB, PREFIX_TOKENS, dtype=np.uint32) for _ in range(n_groups)]
        self.hashes: list[Sequence[int]] = [
            chain(_SEED_BYTES, [p[k * chunk:(k + 1) * chunk].tobytes() for k in range(PREFIX_TOKENS // chunk)])
            for p in self.prefixes]

    def arrivals(self, rate: float, duration: float, page_keys: PageKeys, sla_s: float, id_prefix: str
                 ) -> Iterator[tuple[float, Callable[[], Job]]]:
        """(arrival time, job factory) until `duration`; a job's random tail is drawn when it is made."""
        t, i = 0.0, 0
        while True:
            t += self.rng.expovariate(rate)
            if t > duration:
                return
            g = self.rng.randrange(len(self.prefixes))
            yield t, functools.partial(self._job, g, f"{id_prefix}{i}", i, page_keys, sla_s)
            i += 1

    def _job(self, g: int, rid: str, i: int, page_keys: PageKeys, sla_s: float) -> Job:
        tokens = np.concatenate([self.prefixes[g], self.nrng.integers(0, VOCAB, PROMPT_TOKENS - PREFIX_TOKENS,
                                                                      dtype=np.uint32)])
        group = self.hashes[g]
        tail = self.nrng.integers(-2**63, 2**63 - 1, PROMPT_TOKENS // self.chunk - len(group), dtype=np.int64)
        hashes = (*group, *(int(x) for x in tail))
        req = RoutingRequest(rid, "tenant", "glm-5.2", "chat/completions", True, PROMPT_TOKENS, OUTPUT_TOKENS, hashes,
                             sla_s, "cost", "spill", group_key(hashes, i))
        return Job(req, page_keys(tokens, "tenant"), PROMPT_TOKENS, OUTPUT_TOKENS)


__all__ = ["OUTPUT_TOKENS", "PROMPT_TOKENS", "WaferGroups"]
