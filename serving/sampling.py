"""How the engine chooses each request's next token: :class:`SamplingParams` (OpenAI's and vLLM's fields) and
:func:`choose_tokens`, one pass over the batch's logits.

Order, as vLLM applies them: the penalties (repetition over the prompt and the generated tokens, presence and
frequency over the generated tokens), then temperature 0 is greedy (argmax: token-identical to ``transformers``'
greedy ``generate``); otherwise the logits are divided by the temperature, the softmax is taken in float64,
min-p drops the tokens below ``min_p`` times the most likely one's probability, top-k keeps the ``top_k`` most
likely (and every token tied with the k-th), and top-p keeps, of what those two left renormalized, the smallest
set of most likely tokens whose mass reaches ``top_p`` (0 keeps the most likely alone). One token is drawn from
that subset, renormalized, with the request's own generator: a seeded request draws the same tokens whatever
runs beside it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing

import numpy as np


#: Temperatures below this are greedy (as vLLM's): dividing logits by them overflows float64 to inf, and the softmax of
#: such logits is NaN, where the intent is clearly the most likely token.
GREEDY_BELOW = 1e-5


def _number(name, value, low, high, *, low_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {type(value).__name__} {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
    return float(value)


def _integer(name, value, low, none_ok=False):
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen. ``temperature`` 0 is greedy; ``seed`` (an integer) makes a sampled
    request reproducible whatever runs beside it; ``stop_token_ids`` end it like the model's end-of-sequence ids
    (which ``ignore_eos`` disregards); ``logprobs`` n keeps, per chosen token, its log-probability and the n most
    likely tokens with theirs, in the model's own distribution (before penalties, temperature and filters: vLLM's
    raw logprobs). Every field is checked when it is made
    (``TypeError``/``ValueError`` naming it)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = None
    stop_token_ids: tuple = ()
    stop: tuple = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = None
    ignore_eos: bool = False

    def __post_init__(self):
        check = object.__setattr__
        check(self, "max_tokens", _integer("max_tokens", self.max_tokens, 1))
        check(self, "temperature", _number("temperature", self.temperature, 0.0, math.inf))
        check(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0))  # 0: the most likely token alone
        check(self, "top_k", _integer("top_k", self.top_k, 0))
        check(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0))
        check(self, "seed", _integer("seed", self.seed, 0, none_ok=True))
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        check(self, "stop_token_ids", tuple(_integer("stop_token_ids[i]", t, 0) for t in self.stop_token_ids))
        if not isinstance(self.stop, (str, list, tuple)):  # a set or dict would pass as its members or keys
            raise TypeError(f"stop must be a string or a list of non-empty strings, got {type(self.stop).__name__} "
                            f"{self.stop!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise TypeError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        check(self, "stop", stop)
        check(self, "presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        check(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        check(self, "repetition_penalty", _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                                  low_open=True))
        check(self, "logprobs", _integer("logprobs", self.logprobs, 0, none_ok=True))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below :data:`GREEDY_BELOW`): the most likely token, no draw."""
        return self.temperature < GREEDY_BELOW

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty and no logprobs: the token is the argmax of the raw logits, nothing else is
        computed (the engine's hot path)."""
        return (self.greedy and self.logprobs is None and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty)


class TokenLogprobs(typing.NamedTuple):
    """What ``SamplingParams.logprobs`` keeps per chosen token: its log-probability in the model's own distribution
    (the logits' softmax, before penalties, temperature and filters), and that distribution's ``logprobs`` most
    likely tokens as (token, log-probability), most likely first (the chosen token need not be among them)."""

    logprob: float
    top: list


#: The largest finite float64: logits are kept within +-FINITE, so that no shift of them by their max is inf - inf.
FINITE = float(np.finfo(np.float64).max)


def _penalized(logits: np.ndarray, params: list, histories: list) -> np.ndarray:
    """float64 logits after each row's penalties, within +-FINITE (NaN stays NaN); ``histories[r]``: (prompt ids,
    generated ids). A repetition penalty tiny enough to overflow a seen token's logit leaves it at FINITE (the seen
    tokens so raised tie for the top)."""
    out = logits.astype(np.float64)
    for r, (p, (prompt, generated)) in enumerate(zip(params, histories)):
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(list(prompt) + list(generated), np.int64))
            row = out[r, seen]
            with np.errstate(over="ignore"):  # clipped to +-FINITE below
                out[r, seen] = np.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and len(generated):
            tokens, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
            out[r, tokens] -= p.frequency_penalty * counts + p.presence_penalty
    return np.clip(out, -FINITE, FINITE, out=out)


#: How many of a row's most likely tokens are sorted first for top-p (and eight times more each time they do not
#: reach it): the nucleus is usually far smaller than the vocabulary, and sorting all of it cost 1-2 ms a row.
NUCLEUS_CANDIDATES = 256


def top_in_order(values: np.ndarray, n: int) -> np.ndarray:
    """The indices of the ``n`` largest of ``values`` (1-D), in the order of ``np.argsort(-values, kind="stable")``
    (ties by index; NaN last), found without sorting the rest: every value at least the n-th largest is a prefix of
    that order, and only those are sorted."""
    count = len(values)
    if n <= 0:
        return np.empty(0, np.int64)
    if n >= count:
        return np.argsort(-values, kind="stable")
    nth = -np.partition(-values, n - 1)[n - 1]
    if np.isnan(nth):  # fewer than n values are numbers: NaNs follow them, by index
        return np.argsort(-values, kind="stable")[:n]
    candidates = np.flatnonzero(values >= nth)  # by index: the ties with the n-th keep their order
    return candidates[np.argsort(-values[candidates], kind="stable")][:n]


def _nucleus(kept: np.ndarray, top_p: float) -> np.ndarray:
    """The tokens of the smallest prefix of ``kept`` (a renormalized row) in descending order (ties by index) whose
    cumulative mass reaches ``top_p``, as a full stable sort and cumulative sum would find them: the running sum of
    a prefix is the same whatever follows it, so the most likely tokens are sorted first and more only while their
    mass stays below ``top_p``."""
    count = NUCLEUS_CANDIDATES
    while True:
        order = top_in_order(kept, count)
        mass = np.cumsum(kept[order])
        if count >= len(kept) or (mass.size and mass[-1] >= top_p):
            return order[:int((mass < top_p).sum()) + 1]
        count *= 8


def distributions(logits: np.ndarray, params: list) -> np.ndarray:
    """Per row, the float64 distribution a sampled token is drawn from: softmax of logits / temperature, then
    min-p, top-k and top-p applied in vLLM's order and renormalized (rows of greedy requests are left zero)."""
    probs = np.zeros_like(logits, dtype=np.float64)
    rows = [r for r, p in enumerate(params) if not p.greedy]
    if rows:  # the logits within +-FINITE first, as choose_tokens takes them
        probs[rows] = _sampled_distributions(np.clip(np.asarray(logits, np.float64), -FINITE, FINITE), rows, params)
    return probs


def _sampled_distributions(logits: np.ndarray, rows: list, params: list) -> np.ndarray:
    """:func:`distributions` of ``logits[rows]`` (``params[r]``: row r's, none of ``rows`` greedy), a new array. The
    softmax and min-p in one pass over the rows together, in place; top-k and top-p on the rows that ask for them,
    each sorting only its most likely tokens."""
    chosen = [params[r] for r in rows]
    temperature = np.array([p.temperature for p in chosen])[:, None]
    q = np.asarray(logits, np.float64)[rows]  # a copy (the rows picked), worked on in place
    with np.errstate(over="ignore"):  # a temperature below 1 may overflow a logit near FINITE: clipped back
        np.divide(q, temperature, out=q)
    np.clip(q, -FINITE, FINITE, out=q)
    with np.errstate(over="ignore"):  # -FINITE less a max near FINITE (a row of infinite logits) is -inf: exp 0
        np.subtract(q, q.max(axis=1, keepdims=True), out=q)
    np.exp(q, out=q)
    np.divide(q, q.sum(axis=1, keepdims=True), out=q)
    # min-p over the whole distribution; top-k keeps every token at least as likely as the k-th (ties with it too:
    # equal logits give equal q); top-p then cuts the distribution those two left, renormalized
    keep = None
    if any(p.min_p for p in chosen):
        min_p = np.array([p.min_p for p in chosen])[:, None]
        keep = (min_p == 0) | (q >= min_p * q.max(axis=1, keepdims=True))
    width = q.shape[1]
    for i, p in enumerate(chosen):
        if not p.top_k and p.top_p >= 1.0:
            continue
        if keep is None:
            keep = np.ones(q.shape, bool)
        if p.top_k:
            k = min(p.top_k, width)
            keep[i] &= q[i] >= -np.partition(-q[i], k - 1)[k - 1]  # the k-th largest
        if p.top_p < 1.0:
            kept = np.where(keep[i], q[i], 0.0)
            kept /= kept.sum()
            # tokens of no mass (cut by top-k or min-p) come last and add nothing to the running sums: left out
            candidates = np.flatnonzero(kept)
            nucleus = np.zeros(width, bool)
            nucleus[candidates[_nucleus(kept[candidates], p.top_p)]] = True
            keep[i] &= nucleus
    if keep is not None:
        np.copyto(q, 0.0, where=~keep)
    return np.divide(q, q.sum(axis=1, keepdims=True), out=q)


def _draw(probs: np.ndarray, uniforms: list) -> np.ndarray:
    """One token per row of ``probs`` (consumed: its rows become their running sums) from ``uniforms[r]`` in [0, 1),
    drawn from the row's own generator (so a request's draws do not depend on what runs beside it): the first token
    whose cumulative probability exceeds it times the total."""
    cumulative = np.cumsum(probs, axis=1, out=probs)
    last = probs.shape[1] - 1
    tokens = np.zeros(len(cumulative), np.int64)  # a row of NaN (its logits held one): no sum is at most u, token 0
    for r, (row, uniform) in enumerate(zip(cumulative, uniforms)):
        u = uniform * row[-1]
        if not np.isnan(u):  # the running sums never decrease: how many are at most u is where u goes after its equals
            tokens[r] = min(int(np.searchsorted(row, u, side="right")), last)
    return tokens


def _tokens(scores: np.ndarray, params: list, uniforms) -> np.ndarray:
    """One token per row of the float64 ``scores``: a greedy row's argmax; the others drawn all at once, from
    ``uniforms(rows)`` (those rows' uniforms, in their order)."""
    tokens = np.zeros(len(params), np.int64)
    greedy = [r for r, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = np.argmax(scores[greedy], axis=1)
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    if sampled:
        tokens[sampled] = _draw(_sampled_distributions(scores, sampled, params), uniforms(sampled))
    return tokens


def drawn_tokens(logits: np.ndarray, params: list, uniforms: list) -> np.ndarray:
    """Each row's token as :func:`choose_tokens` chooses it for requests with no penalty whose generators' next draws
    are ``uniforms`` (read for sampled rows only): what the sampling graph gives, chosen on the host."""
    scores = np.clip(np.asarray(logits, np.float64), -FINITE, FINITE)
    return _tokens(scores, params, lambda rows: [uniforms[r] for r in rows])


def model_logprobs(row: np.ndarray) -> np.ndarray:
    """The model's own log-probabilities of one row of logits (float64 log-softmax, logits within +-FINITE): before
    penalties, temperature and filters, as vLLM reports them by default (its raw logprobs) and as OpenAI's do not
    change with the temperature."""
    z = np.clip(np.asarray(row, np.float64), -FINITE, FINITE)
    shifted = z - z.max()
    return shifted - np.log(np.exp(shifted).sum())


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """Each row's most likely token: numpy's ``argmax`` over the last axis (the first of equal maxima; of a row holding
    NaN, its first NaN: ONNX Runtime's ArgMax, which chooses the graph's greedy tokens, passes over NaNs instead, so
    such a row's token depends on which of the two chose it). Float16 rows are widened to float32 first, which keeps
    their order and NaNs, and is faster: numpy's float16 argmax has no vector loop (B=64 x 32,000 logits on a Xeon:
    15 ms, widened 4 ms)."""
    return np.argmax(logits.astype(np.float32) if logits.dtype == np.float16 else logits, axis=-1)


def choose_tokens(logits: np.ndarray, params: list, histories: list, generators: list) -> tuple:
    """(tokens, logprobs): one token per row of ``logits`` ``[rows, vocab]``; ``params[r]``, ``histories[r]``
    (prompt ids, generated ids) and ``generators[r]`` (a numpy Generator) are row r's. ``logprobs[r]``: None, or
    the :class:`TokenLogprobs` of row r's chosen token (``params[r].logprobs`` most likely tokens)."""
    if all(p.plain_greedy for p in params):  # the common case, on the hot path: one argmax over the batch, no copy
        return greedy_tokens(logits).tolist() if len(params) else [], [None] * len(params)
    tokens = _tokens(_penalized(logits, params, histories), params,
                     lambda rows: [generators[r].random() for r in rows])
    logprobs = []
    for r, p in enumerate(params):
        if p.logprobs is None:
            logprobs.append(None)
            continue
        log_q = model_logprobs(logits[r])
        top = top_in_order(log_q, p.logprobs)
        logprobs.append(TokenLogprobs(float(log_q[tokens[r]]), [(int(t), float(log_q[t])) for t in top]))
    return tokens.tolist(), logprobs
