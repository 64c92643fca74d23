"""What the manager keeps per request outside its row, and its records of a step: what each request's
step does (planned before anything changes), and what an applied step changed (to roll it back)."""

import dataclasses

import numpy as np

from .prefix_index import PrefixIndex
from .request_rows import RequestRows
from .step_plan import StepPlan


@dataclasses.dataclass
class Request:
    """What a request keeps outside its row: identity, token history (a list) and prefix chain."""

    rid: object
    row: int  # its row in the manager's RequestRows
    identity: bytes  # salt + cache settings: part of every page's identity
    tokens: list  # ids of positions [token_base, token_base + len(tokens)): the prompt, then what was fed
    token_base: int = 0  # positions before it are no longer needed (registered or outside the window)
    registered: int = 0  # pages [0, registered) are in the prefix index, in chain order
    chain_tail: tuple = (None, PrefixIndex.ROOT)  # (hash, node) of page registered - 1
    chain_open: bool = True  # False once a page could not be registered: no later page can be

    def known(self, begin: int, end: int) -> list:
        """Token ids of positions [begin, end) that are in the list (prompt or fed)."""
        return self.tokens[begin - self.token_base:end - self.token_base]


@dataclasses.dataclass
class RequestWork:
    """The part of a step of one request that is not a plain one-token append, computed (and
    validated) before anything changes."""

    b: int  # index in the batch
    r: Request
    tokens: list  # new token ids
    discard: int  # StreamingLLM: pages dropped after the sinks
    dropped: int  # StreamingLLM: positions those pages held
    end: int  # cache positions [0, end) are stored after the step
    first: int  # first retained page after the step
    released: list  # pages the step gives back (window or discard)
    new_pages: int  # pages the step takes


@dataclasses.dataclass
class RequestUndo:
    """What a step changed in one request outside the batch-wide arrays, to roll it back."""

    r: Request
    token_base: int
    tokens: list  # a copy when the step deletes tokens (discard), else None: tokens are only extended
    tokens_len: int
    table_row: np.ndarray  # the request's page-table row before the step

    def restore(self, rows: RequestRows) -> None:
        r = self.r
        r.token_base = self.token_base
        r.tokens = self.tokens if self.tokens is not None else r.tokens[:self.tokens_len]
        rows.table[r.row] = self.table_row


@dataclasses.dataclass
class PlannedStep:
    """What a step does, decided (and validated) before anything changes."""

    end: np.ndarray  # [B] positions stored after the step
    plain: np.ndarray  # bool [B]: the request's step is a plain one-token append; None: all of them are
    need: np.ndarray  # [B] pages each request takes (a bool mask when every step is plain)
    new_pages: int
    work: list  # RequestWork of the requests whose step is not plain
    steps: int = 1  # steps planned at once: this one, then decode steps (pages are planned for all of them)


@dataclasses.dataclass
class OutstandingStep:
    """The outstanding step: its plan and what it changed."""

    plan: StepPlan
    rids: list  # the batch's request ids (kept here: the caller may change the plan)
    rows: np.ndarray  # their rows
    before: np.ndarray  # their rows' state before the step
    end: np.ndarray  # positions stored after the step
    plain: np.ndarray  # as in PlannedStep
    undo: list  # RequestUndo of the requests whose step is not plain
    appended: tuple  # (rows, columns) of page-table entries plain appends filled, or None
    taken: list  # pages taken from the pool, in order
    released: list  # pages released to the pool, in order
    steps: int = 1  # decode steps planned at once (schedule_decode's steps)
    fed: list = dataclasses.field(default_factory=list)  # [k, B] blocks: the tokens of the steps after the first
    # that ran, in order (one block per advance)
    fed_steps: int = 0  # how many steps those blocks hold
