"""A step's plan: the KeyValueCache op's index inputs (cache_mode 1) and the positions RoPE and the mask
need, built for a whole batch at once from the requests' rows."""

import numpy as np

_EMPTY = np.zeros(0, np.int64)


class _BuiltOnFirstAccess:
    """An attribute that may be set to a function of no arguments: the first read calls it and keeps
    the result."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = getattr(obj, self.slot)
        if callable(value):
            value = value()
            setattr(obj, self.slot, value)
        return value

    def __set__(self, obj, value):
        setattr(obj, self.slot, value)


class StepPlan:
    """One step: the op's index inputs plus the absolute positions RoPE and the mask need.

    ``seqstarts`` [B+1], ``kvstarts`` [B+1], ``cachestarts`` [B, MaxP] (slot of each page, -1 unused),
    ``start_pos`` [B] (position in the op's view, relative to the first retained page), ``max_seqlen``
    and ``max_kvlen`` (int64 scalars), ``query_positions`` [seqstarts[B]] (absolute position of every
    fed token), ``key_positions`` [kvstarts[B]] (absolute position of every gathered key),
    ``fed_tokens`` (request id -> tokens fed, re-evaluated ones first), ``shift_slots``/``shift_deltas``
    [S] (StreamingLLM shift-RoPE-K), ``input_ids`` [seqstarts[B]] (``fed_tokens`` flattened in
    ``request_ids`` order: the model's input ids), ``page_columns`` (how many leading columns of
    ``cachestarts`` hold a page of some sequence; the rest are -1). All index arrays are int64.
    ``input_ids`` and ``page_columns`` are None in plans that carry no tokens (the offset manager's).

    ``key_positions`` and ``fed_tokens`` may be given as functions of no arguments: they are then built
    on first access, so a decode step does not pay for an O(keys) array or a dict of lists its caller
    never reads.
    """

    key_positions = _BuiltOnFirstAccess()
    fed_tokens = _BuiltOnFirstAccess()

    def __init__(self, request_ids, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                 query_positions, key_positions, fed_tokens=None, shift_slots=None, shift_deltas=None,
                 input_ids=None, page_columns=None):
        self.request_ids = request_ids
        self.seqstarts, self.kvstarts, self.cachestarts, self.start_pos = seqstarts, kvstarts, cachestarts, start_pos
        self.max_seqlen, self.max_kvlen = max_seqlen, max_kvlen
        self.query_positions = query_positions
        self.key_positions = key_positions
        self.fed_tokens = {} if fed_tokens is None else fed_tokens
        self.input_ids, self.page_columns = input_ids, page_columns
        self.shift_slots = _EMPTY.copy() if shift_slots is None else shift_slots
        self.shift_deltas = _EMPTY.copy() if shift_deltas is None else shift_deltas
        self._rows_ahead = None  # next_decode's arrays for the decode steps after this one, and which row is next
        self.decode_base = None  # of a step of several tokens that decode steps follow: the plan of a step that fed
        # each request its last token only (the decode steps go on from it)

    def next_decode(self, input_ids: np.ndarray, following: int = 1, later: int = 1) -> "StepPlan":
        """The plan of the decode step after this one (a step of one token each) when the page tables already
        hold its pages: every request one position further, fed ``input_ids`` (int64, one per request). Its arrays
        are of the kinds ``build_plan`` makes (``max_kvlen`` a 0-d int64 array, as ONNX Runtime binds it).

        ``following``: how many decode steps at most follow this one, itself a step of its own (not one made by
        ``next_decode``). Their index arrays are then built together now, and each later plan's are views of one
        row. So a decode loop runs the same few operations every step: code that runs right after a model
        step is slow the first time (measured: an argmax over 4,096 logits takes 16 us just after an ONNX Runtime
        step, 3 us the second time), so fewer distinct operations per step is what makes a step's host work short.
        ``later``: the plan of the step that many decode steps after this one (``input_ids`` fed to it), skipping
        the plans between."""
        if self.decode_base is not None:
            return self.decode_base.next_decode(input_ids, following, later)
        rows = self._rows_ahead
        if not 1 <= later <= (len(rows[0]) - rows[4] if rows is not None else max(following, 1)):
            raise ValueError(f"next_decode: later={later} is outside the planned steps that follow")
        if later > 1 and rows is None:  # a caller that ran the steps between itself: only that step's arrays
            return self._decode_after(later, input_ids)
        if rows is None:
            ahead = np.arange(1, max(following, 1) + 1, dtype=np.int64)[:, None]
            kvstarts = self.kvstarts + ahead * np.arange(len(self.kvstarts), dtype=np.int64)  # each earlier
            # sequence gathers one key more per step
            max_kvlen = (self.max_kvlen + ahead[:, 0]) if len(self.request_ids) else np.zeros(len(ahead), np.int64)
            # lists of each step's views (rows; max_kvlen's as 0-d arrays): a later step only indexes a list
            rows = (list(kvstarts), list(self.start_pos + ahead), list(self.query_positions + ahead),
                    [max_kvlen[j, ...] for j in range(len(max_kvlen))], 0)
        kvstarts_rows, start_pos_rows, position_rows, max_kvlens, i = rows
        i += later - 1
        plan = self._decode_plan(input_ids, kvstarts_rows[i], start_pos_rows[i], position_rows[i], max_kvlens[i])
        plan._rows_ahead = (*rows[:4], i + 1)
        return plan

    def _decode_after(self, later: int, input_ids: np.ndarray) -> "StepPlan":
        """The plan ``later`` decode steps after this one, built alone (see :meth:`next_decode`)."""
        max_kvlen = np.array(self.max_kvlen + later if len(self.request_ids) else 0, np.int64)
        return self._decode_plan(input_ids, self.kvstarts + later * np.arange(len(self.kvstarts), dtype=np.int64),
                                 self.start_pos + later, self.query_positions + later, max_kvlen)

    def _decode_plan(self, input_ids, kvstarts, start_pos, query_positions, max_kvlen) -> "StepPlan":
        """A decode step after this one with these arrays: the same sequences and page tables."""
        rids = self.request_ids
        return StepPlan(
            request_ids=rids, seqstarts=self.seqstarts, kvstarts=kvstarts, cachestarts=self.cachestarts,
            start_pos=start_pos, max_seqlen=self.max_seqlen, max_kvlen=max_kvlen, query_positions=query_positions,
            key_positions=lambda: runs(query_positions - start_pos, start_pos + 1, kvstarts),
            fed_tokens=lambda: {rid: [token] for rid, token in zip(rids, input_ids.tolist())},
            shift_slots=self.shift_slots, shift_deltas=self.shift_deltas,  # empty (decode steps shift nothing)
            input_ids=input_ids, page_columns=self.page_columns)

    def op_inputs(self) -> dict:
        """The op's index inputs by name (cache_mode 1)."""
        return {"seqstarts": self.seqstarts, "kvstarts": self.kvstarts, "cachestarts": self.cachestarts,
                "start_pos": self.start_pos, "max_seqlen": self.max_seqlen, "max_kvlen": self.max_kvlen}

    def __repr__(self) -> str:
        return (f"StepPlan(request_ids={self.request_ids!r}, seqstarts={self.seqstarts!r}, "
                f"kvstarts={self.kvstarts!r}, start_pos={self.start_pos!r})")


def starts_of(lengths: np.ndarray) -> np.ndarray:
    """``[0, cumsum(lengths)]`` as int64."""
    starts = np.empty(len(lengths) + 1, np.int64)
    starts[0] = 0
    np.add.accumulate(lengths, out=starts[1:])
    return starts


def runs(first: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(first[b], first[b] + lengths[b])`` over b, in one pass (``starts``
    is ``starts_of(lengths)``): each element is its global index shifted by its run's offset."""
    total = int(starts[-1])
    if total == len(lengths):  # every run has length 1 (a decode batch)
        return first.astype(np.int64, copy=True)
    return np.arange(total, dtype=np.int64) + np.repeat(first - starts[:-1], lengths)


def build_plan(request_ids, lengths, end, first_slot_pos, cachestarts, fed_tokens,
               shift_slots=None, shift_deltas=None, *, input_ids, page_columns) -> StepPlan:
    """The plan of a step that fed ``lengths[b]`` tokens to request b (``lengths`` None: one token
    each), which then has positions ``[first_slot_pos[b], end[b])`` in its retained pages
    (``first_slot_pos`` = first retained page * page size). ``fed_tokens`` is a dict or a function
    building it; ``input_ids`` the same tokens flattened; ``page_columns`` the columns of
    ``cachestarts`` in use. The arrays passed in must not change later (the lazy ``key_positions``
    reads them)."""
    kvlen = end - first_slot_pos
    kvstarts = starts_of(kvlen)
    if lengths is None:
        seqstarts = np.arange(len(end) + 1, dtype=np.int64)
        start_pos, query_positions = kvlen - 1, end - 1
        max_seqlen = np.array(1 if len(end) else 0, np.int64)
    else:
        seqstarts = starts_of(lengths)
        start_pos, query_positions = kvlen - lengths, runs(end - lengths, lengths, seqstarts)
        max_seqlen = np.array(np.maximum.reduce(lengths, initial=0), np.int64)
    return StepPlan(
        request_ids=request_ids, seqstarts=seqstarts, kvstarts=kvstarts, cachestarts=cachestarts,
        start_pos=start_pos, max_seqlen=max_seqlen, max_kvlen=np.array(np.maximum.reduce(kvlen, initial=0), np.int64),
        query_positions=query_positions, key_positions=lambda: runs(first_slot_pos, kvlen, kvstarts),
        fed_tokens=fed_tokens, shift_slots=shift_slots, shift_deltas=shift_deltas, input_ids=input_ids,
        page_columns=page_columns)
