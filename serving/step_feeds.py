"""A manager's :class:`~kvcache_op.manager.StepPlan` as the feeds of an exported decoder's step."""

from __future__ import annotations

import numpy as np


def step_feeds(plan) -> dict:
    """The graph inputs of one step except ``cache``/``scale``: ``input_ids`` (every sequence's fed
    tokens, ``plan.input_ids``, re-evaluated tokens included), ``positions`` (``plan.query_positions``),
    the KeyValueCache index inputs, and ``decoding_batches``: the number of leading one-token sequences
    (decodes; put them first in the step's feeds). The page tables are cut to the columns this step uses
    (at least one). Arrays are int64 and C-contiguous, the plan's own arrays where they already are (no copy)."""
    if int(plan.max_seqlen) <= 1:  # a decode step (or an empty one): every sequence is one token
        decoding = len(plan.request_ids)
    else:
        lengths = np.diff(plan.seqstarts)
        decoding = int(np.argmin(lengths == 1))
    feeds = dict(input_ids=plan.input_ids, positions=plan.query_positions,
                 decoding_batches=np.array(decoding, np.int64), **plan.op_inputs())
    # Page tables are as wide as the longest context allowed; the step needs only its longest one.
    feeds["cachestarts"] = feeds["cachestarts"][:, :max(plan.page_columns, 1)]
    return {k: v if _ready(v) else np.require(v, np.int64, "C") for k, v in feeds.items()}  # keeps scalars 0-d


def _ready(value) -> bool:
    """Whether ``value`` is already what ONNX Runtime binds without a copy: an int64 C-contiguous array."""
    return type(value) is np.ndarray and value.dtype == np.int64 and value.flags.c_contiguous


#: The feeds a decode step planned ahead changes (``next_decode_feeds``); the others stay as the step before had them.
NEXT_DECODE_CHANGES = ("input_ids", "positions", "kvstarts", "start_pos", "max_kvlen")


def next_decode_feeds(feeds: dict, plan) -> dict:
    """The feeds of ``plan``, a decode step planned ahead (:meth:`~kvcache_op.manager.StepPlan.next_decode`), from
    ``feeds``, the step before it's: only :data:`NEXT_DECODE_CHANGES` differ (the plan's own arrays), the page tables
    and sizes are the same objects."""
    return {**feeds, "input_ids": plan.input_ids, "positions": plan.query_positions, "kvstarts": plan.kvstarts,
            "start_pos": plan.start_pos, "max_kvlen": plan.max_kvlen}
