"""Offset-mode (cache_mode 0) allocation: each request owns one contiguous run of slots, reserved at
admission for its prompt plus the tokens it may generate. No prefix sharing: a shared prefix needs
pages (cache_mode 1, :class:`KVCacheManager`).

Its steps are not transactions: ``schedule`` moves each request's position on at once (there is no
``commit``/``abort``). A caller whose op failed on a step finishes the request, or admits it again and
feeds it from the start: nothing here was shared, so nothing else is affected."""

import bisect
import dataclasses

import numpy as np

from .errors import UnknownRequest
from .identity import check_int
from .kv_manager import StepPlan


class OutOfSlots(RuntimeError):
    """No contiguous free run is long enough; nothing was changed."""

    def __init__(self, needed: int, largest: int):
        super().__init__(f"need {needed} contiguous slots, the largest free run has {largest}")
        self.needed = needed
        self.largest = largest


@dataclasses.dataclass
class _Region:
    start: int
    length: int
    computed: int = 0


class OffsetCacheManager:
    """Contiguous regions in ``max_t`` slots: first fit, freed runs merged with their neighbours."""

    def __init__(self, max_t: int):
        max_t = check_int("max_t", max_t)
        if max_t < 1:
            raise ValueError(f"max_t must be >= 1, got {max_t}")
        self.max_t = max_t
        self.free_starts = [0]  # sorted starts of free runs
        self.free_lengths = {0: max_t}
        self.regions = {}

    def add_request(self, rid, max_tokens: int) -> int:
        """Reserves ``max_tokens`` contiguous slots (prompt + generation); returns the first slot.
        ``TypeError`` for a non-integer size (nothing is truncated)."""
        if rid in self.regions:
            raise ValueError(f"request {rid!r} is already active")
        max_tokens = check_int("max_tokens", max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        for start in self.free_starts:
            length = self.free_lengths[start]
            if length >= max_tokens:
                self._take(start, length, max_tokens)
                self.regions[rid] = _Region(start, max_tokens)
                return start
        raise OutOfSlots(max_tokens, max(self.free_lengths.values(), default=0))

    def _take(self, start, length, n):
        self.free_starts.remove(start)
        del self.free_lengths[start]
        if length > n:
            bisect.insort(self.free_starts, start + n)
            self.free_lengths[start + n] = length - n

    def finish(self, rid) -> None:
        """Returns the request's run, merged with adjacent free runs."""
        region = self.regions.pop(rid, None)
        if region is None:
            raise UnknownRequest(rid)
        start, length = region.start, region.length
        i = bisect.bisect_left(self.free_starts, start)
        if i < len(self.free_starts) and self.free_starts[i] == start + length:  # merge the next run
            length += self.free_lengths.pop(self.free_starts.pop(i))
        if i > 0 and self.free_starts[i - 1] + self.free_lengths[self.free_starts[i - 1]] == start:  # previous
            self.free_lengths[self.free_starts[i - 1]] += length
            return
        bisect.insort(self.free_starts, start)
        self.free_lengths[start] = length

    def schedule(self, counts: dict) -> StepPlan:
        """``counts`` maps request id -> tokens fed this step; returns the op's inputs for cache_mode 0.
        Every count is checked (an integer that fits the reservation) before anything changes."""
        if not isinstance(counts, dict):
            raise TypeError(f"counts must be a dict of request id -> tokens fed, got {type(counts).__name__}")
        plans = []
        for rid, n in counts.items():
            region = self.regions.get(rid)
            if region is None:
                raise UnknownRequest(rid)
            n = check_int(f"request {rid!r}: token count", n)
            if n < 1 or region.computed + n > region.length:
                raise ValueError(f"request {rid!r}: {n} tokens at position {region.computed} overflow its "
                                 f"reservation of {region.length}")
            plans.append((region, n))
        seqstarts, kvstarts, qpos, kpos = [0], [0], [], []
        for region, n in plans:
            seqstarts.append(seqstarts[-1] + n)
            kvstarts.append(kvstarts[-1] + region.computed + n)
            qpos.append(np.arange(region.computed, region.computed + n))
            kpos.append(np.arange(region.computed + n))
        start_pos = [region.computed for region, _ in plans]
        for region, n in plans:
            region.computed += n
        return StepPlan(
            request_ids=list(counts), seqstarts=np.array(seqstarts, np.int64), kvstarts=np.array(kvstarts, np.int64),
            cachestarts=np.array([region.start for region, _ in plans], np.int64),
            start_pos=np.array(start_pos, np.int64),
            max_seqlen=np.array(np.diff(seqstarts).max(initial=0), np.int64),
            max_kvlen=np.array(np.diff(kvstarts).max(initial=0), np.int64),
            query_positions=np.concatenate(qpos) if qpos else np.zeros(0, np.int64),
            key_positions=np.concatenate(kpos) if kpos else np.zeros(0, np.int64))

    def check(self) -> None:
        """Asserts (tests): runs and regions tile [0, max_t) exactly, free runs never adjacent."""
        spans = sorted([(s, self.free_lengths[s], "free") for s in self.free_starts] +
                       [(r.start, r.length, "used") for r in self.regions.values()])
        cursor, last = 0, None
        for start, length, kind in spans:
            assert start == cursor and length > 0, spans
            assert not (kind == last == "free"), "two adjacent free runs were not merged"
            cursor, last = start + length, kind
        assert cursor == self.max_t
