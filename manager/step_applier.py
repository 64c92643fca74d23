"""Applying a planned step: page tables, positions and token lists change, pages are taken and released:
part of :class:`~.kv_manager.KVCacheManager`. Everything a step changes is recorded in its
:class:`~.step_records.OutstandingStep`, so ``abort`` can roll it back.
"""

import numpy as np

from .step_plan import StepPlan, build_plan
from .step_records import OutstandingStep, PlannedStep, Request, RequestUndo, RequestWork


class StepApplier:
    """The manager's step application and StreamingLLM discards (uses its ``rows``, ``pool``, ``index``,
    ``requests``, ``streaming`` and ``_pending``)."""

    def _apply(self, rids, rows, before, lengths, ids, planned: PlannedStep) -> StepPlan:
        ps, R, plain, need = self.page_size, self.rows, planned.plain, planned.need
        step = OutstandingStep(None, rids, rows, before, planned.end, plain, [], None, [], [], planned.steps)
        fed, shift_slots, shift_deltas = {}, [], []
        for w in planned.work:  # every release before any allocation: schedule() counted on them
            r = w.r
            step.undo.append(RequestUndo(r, r.token_base, list(r.tokens) if w.discard else None, len(r.tokens),
                                   R.table[r.row].copy()))
            self._fold_tail(r)
            if w.discard:
                slots, refeed = self._discard(r, w)
                if slots.size:
                    shift_slots.append(slots)
                    shift_deltas.append(np.full(slots.size, -w.dropped, np.int64))
                fed[w.b] = refeed + w.tokens
            elif w.released:
                self._drop_first_pages(r.row, len(w.released))
                R.first_page[r.row] = w.first
            for page in w.released:
                self.pool.release(page, cached=self.index.is_cached(page))
            step.released += w.released
        if planned.new_pages:  # pages in batch order, as each request asks for them
            step.taken = self.pool.take_many(planned.new_pages)
            self._hand_out(step, np.array(step.taken, np.int64) * ps, need, planned.work)
        # A plain append puts its token in the tail buffer; the request's token list stays as it is.
        computed = before[:, 0]
        if plain is None:
            R.tail[rows, computed % ps] = ids
        else:
            first_ids = ids if lengths is None else ids[np.cumsum(lengths) - lengths]
            R.tail[rows[plain], computed[plain] % ps] = first_ids[plain]
        R.computed[rows] = planned.end
        for w in planned.work:
            r, tokens = w.r, fed.get(w.b, w.tokens)
            start = w.end - len(tokens)
            r.tokens[start - r.token_base:w.end - r.token_base] = tokens
            R.known_end[r.row] = r.token_base + len(r.tokens)
        if fed:  # StreamingLLM re-evaluation feeds kept tokens again: lengths and ids change
            lengths, ids = self._refed(lengths, ids, fed)
        ids.setflags(write=False)  # the plan's input_ids, read by fed_tokens later: an edit of the feeds fails
        first_slot = (before[:, 1] if plain is None else R.first_page[rows]) * ps
        cachestarts, page_columns = R.table.take(rows, axis=0), int(np.maximum.reduce(R.npages[rows], initial=0))
        step.plan = build_plan(
            list(rids), lengths, planned.end, first_slot, cachestarts,
            self._fed_tokens(rids, lengths, ids),
            np.concatenate(shift_slots) if shift_slots else None,
            np.concatenate(shift_deltas) if shift_deltas else None,
            input_ids=ids, page_columns=page_columns)
        if planned.steps > 1 and lengths is not None:  # decode steps follow a step of several tokens: they go on
            # from a step that fed each request only its last token (the decode step the first one ends as)
            last = ids[np.cumsum(lengths) - 1]
            step.plan.decode_base = build_plan(list(rids), None, planned.end, first_slot, cachestarts,
                                               self._fed_tokens(rids, None, last), input_ids=last,
                                               page_columns=page_columns)
        self._pending = step
        return step.plan

    def _settle_steps(self, step: OutstandingStep) -> None:
        """Of the steps planned at once (``step.steps``: a first step, then decode steps), the first
        ``1 + step.fed_steps`` ran: the rows take the decode steps' tokens (in the tail buffer; a row whose steps
        crossed into a new page first folds the page it filled onto its token list, as a step ending it would
        have), pages taken for steps that did not run go back to the pool (never written, never published), and
        ``step.end`` becomes where each row now ends."""
        R, ps, rows = self.rows, self.page_size, step.rows
        ran = 1 + step.fed_steps
        first_end = step.end  # where each row ends after the first step (the decode steps' first position)
        end = first_end + (ran - 1)
        if step.appended is not None and ran < step.steps:
            table_rows, columns = step.appended
            # a page reached by no step that ran starts after the row's last position (rows hold the first step's
            # end until now: last position = that end - 1 + ran - 1)
            unused = np.flatnonzero(R.computed[table_rows] + (ran - 2) < (R.first_page[table_rows] + columns) * ps)
            for u in unused[::-1].tolist():
                page = int(R.table[table_rows[u], columns[u]]) // ps
                self.pool.untake(page)
            R.table[table_rows[unused], columns[unused]] = -1
            np.minimum.at(R.npages, table_rows[unused], columns[unused])  # a row's first unused column
        if ran > 1:
            fed = np.concatenate(step.fed).T  # [B, ran - 1]: positions first_end, first_end + 1, ...
            crossed = (end - 1) // ps > (first_end - 1) // ps
            straight = np.flatnonzero(~crossed)
            positions = first_end[straight, None] + np.arange(ran - 1)
            R.tail[rows[straight, None], positions % ps] = fed[straight]
            for b in np.flatnonzero(crossed).tolist():
                row, first, start, last = int(rows[b]), int(first_end[b]), int(first_end[b]), int(end[b])
                for boundary in range(-(-first // ps) * ps, last, ps):  # each page the steps filled
                    R.tail[row, np.arange(start, boundary) % ps] = fed[b, start - first:boundary - first]
                    R.computed[row] = boundary
                    self._fold_tail(self.requests[step.rids[b]])  # its tokens, before its slots are reused
                    start = boundary
                R.tail[row, np.arange(start, last) % ps] = fed[b, start - first:]
        R.computed[rows] = end
        step.end = end

    def _hand_out(self, step: OutstandingStep, slots: np.ndarray, need: np.ndarray, work: list) -> None:
        """Appends the pages just taken (``slots``: their first slots, in batch order) to the page tables
        of the requests that asked for them (``need``: how many each)."""
        R, rows = self.rows, step.rows
        if need.dtype != bool and (step.plain is None or step.steps > 1):  # decode steps planned at once past a
            # page, or after a step of several tokens (nothing is released then): counts
            counts = need
            appended = np.repeat(np.arange(len(counts)), counts)  # each request's pages, in batch order
            within = np.arange(len(appended)) - np.repeat(np.cumsum(counts) - counts, counts)
            cols = step.before[appended, 2] + within
            step.appended = (rows[appended], cols)
            R.table[step.appended] = slots
            taking = np.flatnonzero(counts)
            R.npages[rows[taking]] = step.before[taking, 2] + counts[taking]
            return
        if step.plain is None:  # every request's step is plain: need is a bool mask
            appended = np.flatnonzero(need)
            offsets, starts = np.arange(len(appended)), None
        else:
            starts = np.cumsum(need) - need
            appended = np.flatnonzero(step.plain & (need > 0))
            offsets = starts[appended]
        cols = step.before[appended, 2]
        step.appended = (rows[appended], cols)
        R.table[step.appended] = slots[offsets]
        R.npages[rows[appended]] = cols + 1
        for w in work:
            n0, start = int(R.npages[w.r.row]), int(starts[w.b])
            R.table[w.r.row, n0:n0 + w.new_pages] = slots[start:start + w.new_pages]
            R.npages[w.r.row] = n0 + w.new_pages

    @staticmethod
    def _refed(lengths, ids, fed: dict) -> tuple:
        """(lengths, ids) of a batch after some requests' feeds were replaced (``fed``: index -> ids)."""
        lengths = np.ones(len(ids), np.int64) if lengths is None else lengths.copy()
        flat, ends, all_fed = ids.tolist(), np.cumsum(lengths).tolist(), []
        for b, (end, n) in enumerate(zip(ends, lengths.tolist())):
            all_fed += fed.get(b, flat[end - n:end])
        for b, tokens in fed.items():
            lengths[b] = len(tokens)
        return lengths, np.array(all_fed, np.int64)

    @staticmethod
    def _fed_tokens(rids: list, lengths, ids: np.ndarray):
        """A function building the plan's ``fed_tokens`` on demand (from arrays no one else changes)."""

        def build() -> dict:
            flat = ids.tolist()
            if lengths is None:
                return {rid: [token] for rid, token in zip(rids, flat)}
            ends = np.cumsum(lengths).tolist()
            return {rid: flat[end - n:end] for rid, end, n in zip(rids, ends, lengths.tolist())}

        return build

    def _drop_first_pages(self, row: int, k: int) -> None:
        """Removes the first ``k`` retained pages from the row's table (the window moved past them)."""
        R, n = self.rows, int(self.rows.npages[row])
        R.table[row, :n - k] = R.table[row, k:n].copy()
        R.table[row, n - k:n] = -1
        R.npages[row] = n - k

    def _fold_tail(self, r: Request) -> None:
        """Moves the decode tokens held in the row's tail buffer onto the request's token list."""
        R, row = self.rows, r.row
        known_end, computed = int(R.known_end[row]), int(R.computed[row])
        if computed > known_end:
            r.tokens += R.tail[row, np.arange(known_end, computed) % self.page_size].tolist()
            R.known_end[row] = computed

    # StreamingLLM --------------------------------------------------------------------------------
    def _discard(self, r: Request, w: RequestWork) -> tuple:
        """Drops ``w.discard`` pages (``w.dropped`` positions) after the sinks. Returns (slots to shift by
        ``-w.dropped``, tokens to re-feed)."""
        R, row, ps, s = self.rows, r.row, self.page_size, self.sink_pages
        sink_end = s * ps
        old_computed, held = int(R.computed[row]), int(R.npages[row])
        del r.tokens[sink_end - r.token_base:sink_end + w.dropped - r.token_base]
        R.known_end[row] -= w.dropped
        if self.streaming.mode == "shift":
            kept_positions = np.arange(sink_end + w.dropped, old_computed)
            slots = R.table[row, kept_positions // ps] + kept_positions % ps
            R.table[row, s:held - w.discard] = R.table[row, s + w.discard:held].copy()
            R.table[row, held - w.discard:held] = -1
            R.npages[row] = held - w.discard
            R.computed[row] = old_computed - w.dropped
            return slots, []
        R.table[row, s:held] = -1
        R.npages[row] = s
        R.computed[row] = sink_end
        return np.zeros(0, np.int64), r.known(sink_end, old_computed - w.dropped)
