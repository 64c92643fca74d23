"""Planning a step, with nothing changed yet: part of :class:`~.kv_manager.KVCacheManager`.

Most requests of a decode step are plain appends (one generated token, at most one new page, nothing released
or discarded): they are planned by a few numpy operations over the whole batch. Only the others (prefill
chunks, window releases, StreamingLLM discards) are planned request by request.
"""

import numpy as np

from .step_records import PlannedStep, Request, RequestWork
from .streaming import streaming_discard


class StepPlanner:
    """The manager's planning (reads its ``rows``, ``requests`` and configuration; changes nothing)."""

    def _plan(self, rids, before, lengths, ids, steps: int = 1) -> PlannedStep:
        """What the step does to each request, from the rows as they are (``before``); ``ValueError``
        for a step no page table can describe. ``steps`` > 1 (one token each, ``lengths`` None): pages are
        planned for that many decode steps, each request's next ``steps`` positions."""
        ps = self.page_size
        computed, first, held, known_end = before.T
        end = computed + (1 if lengths is None else lengths)
        # A plain append: one generated token (nothing of the prompt to check), at most one new page,
        # nothing released by the window, no StreamingLLM discard.
        plain = computed >= known_end
        if lengths is not None:
            plain &= lengths == 1
        if self.sliding_window is not None:
            plain &= np.maximum(computed - self.sliding_window + 1, 0) // ps <= first
        if self.streaming is not None:
            plain &= end <= self.streaming.budget_pages * ps
        # For a plain append: the token (of several decode steps: the last one) lies past the pages held. At most
        # a page of steps takes at most one page (a bool mask); more steps may take several (counts).
        need = (computed if steps == 1 else computed + (steps - 1)) >= (first + held) * ps
        if steps > ps:
            need = np.maximum((computed + (steps - 1)) // ps - (first + held) + 1, 0)
        all_plain = np.count_nonzero(plain) == len(plain)
        if steps > 1 and not all_plain and (end < known_end).any():
            b = int(np.argmax(end < known_end))
            raise ValueError(f"request {rids[b]!r} has prompt tokens to feed after this step: decode steps planned "
                             f"at once need every request's feed to reach the end of its prompt")
        if not all_plain:
            need = need & plain if need.dtype == bool else np.where(plain, need, 0)
        new_pages = int(np.count_nonzero(need)) if need.dtype == bool else int(need.sum())
        # (the maximum first: one reduction where, as almost always, no request holds max_pages pages)
        if new_pages and held.max() + (1 if need.dtype == bool else need.max()) > self.max_pages and \
                (held + need > self.max_pages).any():
            if steps > 1:  # _check_each checks one step: name the request here
                b = int(np.argmax(held + need > self.max_pages))
                raise ValueError(f"request {rids[b]!r}: {steps} decode steps need more than max_pages="
                                 f"{self.max_pages} pages")
            raise ValueError("a request's step needs more than max_pages pages")  # _check_each says which
        work = []
        if not all_plain:
            need = need.astype(np.int64)
            ends = np.arange(1, len(rids) + 1) if lengths is None else np.cumsum(lengths)
            starts = (ends - 1 if lengths is None else ends - lengths).tolist()
            ends = ends.tolist()
            for b in np.flatnonzero(~plain).tolist():
                r = self.requests[rids[b]]
                tokens = ids[starts[b]:ends[b]].tolist()
                self._check_feed(r, tokens)
                w = self._plan_request(b, r, tokens, steps - 1)
                need[b], end[b] = w.new_pages, w.end
                new_pages += w.new_pages
                work.append(w)
        return PlannedStep(end, None if all_plain else plain, need, new_pages, work, steps)

    def _plan_request(self, b: int, r: Request, tokens: list, later: int = 0) -> RequestWork:
        """``later``: decode steps planned after this one (their pages are taken now)."""
        ps, R, row = self.page_size, self.rows, r.row
        computed, first_page, held = int(R.computed[row]), int(R.first_page[row]), int(R.npages[row])
        discard, dropped = (streaming_discard(self.streaming, self.sink_pages, ps, r.rid, computed, held, len(tokens))
                            if self.streaming is not None else (0, 0))
        end = computed - dropped + len(tokens)
        first = first_page
        if self.sliding_window is not None:
            first = max(first, max(0, computed - self.sliding_window + 1) // ps)
        pages_total = -(-(end + later) // ps)
        if pages_total - first > self.max_pages:
            raise ValueError(f"request {r.rid!r}: {pages_total - first} pages exceed max_pages={self.max_pages}")
        released = []
        if discard:
            s = self.sink_pages
            released = R.pages(row)[s:s + discard] if self.streaming.mode == "shift" else R.pages(row)[s:]
        elif first > first_page:
            released = R.pages(row)[:first - first_page]
        new_pages = pages_total - first - (held - len(released))
        return RequestWork(b, r, tokens, discard, dropped, end, first, released, new_pages)
