"""Finding a step's requests and checking what they are fed: part of :class:`~.kv_manager.KVCacheManager`.

A decode loop feeds the same batch step after step: the last batch's ids and rows are kept, and a batch of
the same plain ids in the same order reuses its rows instead of looking each id up again.
"""

import operator

import numpy as np

from .identity import token_batch, token_ids
from .step_records import Request

#: Request ids of these exact types name the same request exactly when they compare equal (equal values hash
#: alike, and comparing never raises), so a list of them equal to the last batch's names the same requests.
#: Other ids (numpy scalars, tuples, floats, custom classes) can be equal without being the same dict key, or
#: fail to compare: their batches are looked up afresh every step.
_PLAIN_IDS = frozenset((int, str))


class BatchLookup:
    """The manager's batch lookup and per-request checks (uses its ``requests``, ``rows``, ``_row_of`` and
    ``_last_batch``)."""

    def _batch_of(self, feeds: dict, rids: list):
        """(rows, lengths, ids) of a batch of known requests fed lists of valid ids, in one pass
        (``lengths`` None when every request is fed one token); None when that does not hold (the
        per-request check then finds out why)."""
        if not rids:
            return np.zeros(0, np.intp), None, np.zeros(0, np.int64)
        rows = self._cached_rows(rids)
        if rows is None:
            try:
                rows = operator.itemgetter(*rids)(self._row_of)
            except (KeyError, TypeError):  # TypeError: an unhashable id
                return None
            rows = self._remember_rows(rids, np.array(rows if len(rids) > 1 else [rows], np.intp))
        tokens = token_batch(list(feeds.values()), self.vocab_size)
        if tokens is None:
            return None
        return rows, tokens[0], tokens[1]

    def _rows_of(self, rids: list) -> np.ndarray:
        """The rows of distinct active requests; ``UnknownRequest``/``ValueError`` otherwise."""
        cached = self._cached_rows(rids)
        if cached is not None:
            return cached
        try:
            rows = operator.itemgetter(*rids)(self._row_of) if len(rids) > 1 else [self._row_of[r] for r in rids]
        except (KeyError, TypeError):
            for rid in rids:
                self._get(rid)  # raises for the first unknown one
            raise
        rows = np.array(rows, np.intp)
        if len(rows) > 1 and np.bincount(rows).max() > 1:
            seen = set()
            for rid in rids:
                if rid in seen:
                    raise ValueError(f"request {rid!r} appears twice in one step")
                seen.add(rid)
        return self._remember_rows(rids, rows)

    def _cached_rows(self, rids: list):
        """The rows of ``rids`` if they are the last batch's ids, in the same order; else None. Only
        lists of plain ids are compared (see ``_PLAIN_IDS``)."""
        last = self._last_batch
        if last is None or len(last[0]) != len(rids) or not set(map(type, rids)) <= _PLAIN_IDS:
            return None
        return last[1] if last[0] == rids else None

    def _remember_rows(self, rids: list, rows: np.ndarray) -> np.ndarray:
        """Keeps ``rows`` (made read-only: plans and records share it) as the rows of ``rids`` (the
        caller's own list, which nothing changes later) for the next step's lookup, if the ids are
        plain."""
        rows.flags.writeable = False
        self._last_batch = (rids, rows) if set(map(type, rids)) <= _PLAIN_IDS else None
        return rows

    def _check_each(self, feeds: dict) -> tuple:
        """The batch of ``feeds`` checked request by request, exactly as a step would use it; raises the
        error of the first bad request (unknown, bad or empty tokens, tokens that contradict the
        prompt, a step no page table can describe)."""
        rows, lengths, ids = [], [], []
        for rid, tokens in feeds.items():
            r = self._get(rid)
            tokens = token_ids(tokens, self.vocab_size, f"request {rid!r}: fed tokens")
            self._check_feed(r, tokens)
            self._plan_request(0, r, tokens)
            rows.append(r.row)
            lengths.append(len(tokens))
            ids += tokens
        return np.array(rows, np.intp), np.array(lengths, np.int64), np.array(ids, np.int64)

    def _check_feed(self, r: Request, tokens: list) -> None:
        if not tokens:
            raise ValueError(f"request {r.rid!r}: a step must feed at least one token")
        c = int(self.rows.computed[r.row])
        known = r.known(c, c + len(tokens))
        if tokens[:len(known)] != known:
            raise ValueError(f"request {r.rid!r}: fed tokens differ from the prompt at positions {c}..")
