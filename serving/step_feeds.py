"""A manager's :class:`~kvcache_op.manager.StepPlan` as the feeds of an exported decoder's step."""

from __future__ import annotations

import numpy as np


def step_feeds(plan) -> dict:
    """The graph inputs of one step except ``cache``/``scale``: ``input_ids`` (every sequence's fed
    tokens, ``plan.fed_tokens`` in ``plan.request_ids`` order, re-evaluated tokens included),
    ``positions`` (``plan.query_positions``), the KeyValueCache index inputs, and ``decoding_batches``:
    the number of leading one-token sequences (decodes; put them first in the step's feeds). The page
    tables are cut to the columns this step uses. Arrays are int64 and C-contiguous, the plan's own
    arrays where they already are (no copy)."""
    lengths = np.diff(plan.seqstarts)
    tokens = [plan.fed_tokens[rid] for rid in plan.request_ids]
    input_ids = np.fromiter((t for seq in tokens for t in seq), np.int64, count=int(plan.seqstarts[-1]))
    decoding = int(np.argmin(lengths == 1)) if (lengths != 1).any() else len(lengths)
    feeds = dict(input_ids=input_ids, positions=plan.query_positions, decoding_batches=np.array(decoding, np.int64),
                 **plan.op_inputs())
    # Page tables are as wide as the longest context allowed; the step needs only its longest one.
    table = feeds["cachestarts"]
    used = np.flatnonzero((table >= 0).any(axis=0))
    feeds["cachestarts"] = table[:, :used[-1] + 1 if used.size else 1]
    return {k: np.require(v, np.int64, "C") for k, v in feeds.items()}  # keeps scalars 0-d
