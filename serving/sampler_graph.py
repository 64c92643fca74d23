"""Token sampling as a small ONNX graph over a step's logits, so that on a GPU the logits never leave the device:
:func:`sampler_model` takes the logits ``[B, vocab]`` and, per row, the request's temperature, top-k, top-p, min-p
and one uniform drawn on the host from the request's own generator, and gives each row's token.

It computes what :func:`~.sampling.choose_tokens` computes for requests with no penalty and no logprobs, in
float64 as the host does: the softmax of the logits over the temperature (within +-FINITE), min-p, top-k (every
token tied with the k-th kept) and top-p (the smallest most-likely-first prefix, ties by index, whose running mass
reaches top_p) of what those two left renormalized, then the first token whose running sum in token order exceeds
``uniform`` times the total. A row whose temperature is below :data:`~.sampling.GREEDY_BELOW` takes its ArgMax.
The host's and the graph's sums add in different orders, so the two agree to float64 rounding, not bit for bit:
a token differs only where the uniform falls within that rounding of a boundary between two tokens' running sums,
or where a nucleus's mass is within it of top_p, or a token's probability within it of min-p's threshold.

Min-p and top-k keep the tokens at least as likely as a threshold, so they need no sort but the k-th most likely;
top-p needs each row's most likely values in order. The graph sorts :data:`SORT_WIDTH` of them (one TopK, whose
values alone it reads: the nucleus's ties with its last token are taken by index, counted in token order), as few as
the step's requests need: one without top-k or top-p, the largest top-k, and :data:`NUCLEUS_SORT` with top-p. Sorting
whole rows of a real vocabulary would cost a GPU one sort per row (ONNX Runtime's CUDA TopK sorts more than 4,096 a
row one row at a time) and the CPU 180 ms for 64 x 32,000. A row whose nucleus the sorted tokens do not reach, where
more tokens of mass are kept than were sorted, is marked incomplete (:data:`COMPLETE` false): its token is then chosen
on the host (:func:`~.sampling.drawn_tokens`, from the same uniform).

Every node has a float64 kernel in ONNX Runtime's CPU and CUDA EPs, so CI runs the graph the GPU runs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..spec.model import DEFAULT_OPSET, IR_VERSION
from .sampling import FINITE, GREEDY_BELOW, SamplingParams, drawn_tokens

LOGITS = "logits"
#: The per-row inputs besides the logits, each ``[B]``: float64 but ``top_k`` (int64, 0: none).
PARAMETER_INPUTS = ("temperature", "top_k", "top_p", "min_p", "uniform")
#: How many of each row's most likely tokens the graph sorts: int64 ``[1]``, from 1 to the vocabulary.
SORT_WIDTH = "sort_width"
#: The graph's outputs: each row's token (int64 ``[B]``); whether its token is the host's (bool ``[B]``: false where
#: top-p's nucleus or top-k's k-th token lies past the sorted ones); and, where asked for, the float64 distribution it
#: was drawn from (``[B, vocab]``, a greedy row's zero: :func:`~.sampling.distributions`).
TOKENS, COMPLETE, DISTRIBUTION = "tokens", "complete", "distribution"
#: The tokens a step with top-p sorts: a trained model's nucleus at top_p 0.9-0.95 is mostly tens to hundreds of
#: tokens, and ONNX Runtime's CUDA TopK sorts up to 4,096 a row in one kernel for the whole batch.
NUCLEUS_SORT = 1024
#: The columns a row's running sums are added in at a time (see :func:`_running_sums`): about the square root of a
#: vocabulary's width.
RUNNING_CHUNK = 128


def graph_samplable(params: SamplingParams) -> bool:
    """Whether the graph chooses this request's tokens as the host would: no penalty (they need the request's
    history) and no logprobs (they need its logits on the host)."""
    return (params.logprobs is None and params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty)


def sampler_feeds(params: list, uniforms: list, vocab: int) -> dict:
    """The graph's inputs but the logits, for rows chosen by ``params`` (each :func:`graph_samplable`, or None for a
    row whose token is not wanted, fed as greedy) over ``vocab`` logits a row; ``uniforms[r]``: row r's draw in
    [0, 1) (ignored for greedy rows). The sort width is the least the rows need (see the module)."""
    rows = len(params)
    feeds = {"temperature": np.zeros(rows), "top_k": np.zeros(rows, np.int64), "top_p": np.ones(rows),
             "min_p": np.zeros(rows), "uniform": np.zeros(rows)}
    width = 1
    for r, p in enumerate(params):
        if p is None or p.greedy:
            continue
        top_k = p.top_k if p.top_k < vocab else 0  # every token is at least as likely as the last
        feeds["temperature"][r], feeds["top_k"][r], feeds["top_p"][r] = p.temperature, top_k, p.top_p
        feeds["min_p"][r], feeds["uniform"][r] = p.min_p, uniforms[r]
        width = max(width, top_k, NUCLEUS_SORT if p.top_p < 1.0 else 1)
    feeds[SORT_WIDTH] = np.array([min(width, vocab)], np.int64)
    return feeds


def host_drawn(logits: np.ndarray, feeds: dict, rows) -> np.ndarray:
    """The tokens of ``rows`` of a step fed ``feeds`` (:func:`sampler_feeds`'), ``logits`` theirs, chosen on the host
    (:func:`~.sampling.drawn_tokens`): what the graph gives where it is complete."""
    params = [SamplingParams(temperature=float(feeds["temperature"][r]), top_k=int(feeds["top_k"][r]),
                             top_p=float(feeds["top_p"][r]), min_p=float(feeds["min_p"][r])) for r in rows]
    return drawn_tokens(logits, params, [float(feeds["uniform"][r]) for r in rows])


class _Graph:
    """Builds the node list; each method adds one node and returns its output's name."""

    def __init__(self):
        self.nodes, self.initializers, self._count = [], [], 0

    def __getattr__(self, op):
        return lambda *inputs, **attributes: self.node(op, inputs, 1, **attributes)[0]

    def node(self, op, inputs, outputs: int, **attributes) -> list:
        """Adds an ``op`` node of ``outputs`` outputs; returns their names."""
        self._count += 1
        names = [f"{op.lower()}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), names, **attributes))
        return names

    def constant(self, name, value, dtype) -> str:
        array = np.asarray(value, dtype)
        self.initializers.append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(array.dtype),
                                                    array.shape, array.ravel().tolist()))
        return name


def _running_sums(g: _Graph, x: str, chunk: int) -> str:
    """The running sums of ``x`` ``[B, W]`` along its rows (CumSum's, added in another order): each chunk of
    ``chunk`` columns' own running sums plus the sum of the chunks before it. ONNX Runtime's CUDA CumSum adds each
    element's predecessors one by one, W^2 / 2 additions a row (2 x 10^9 for a 64-row batch of 32,000 logits): in
    chunks it is about (chunk + W / chunk) / 2 an element."""
    axis1, axis2 = g.constant(f"{x}_axis1", 1, np.int64), g.constant(f"{x}_axis2", 2, np.int64)
    size = g.constant(f"{x}_chunk", [chunk], np.int64)
    width = g.Shape(x, start=1, end=2)  # [1]
    padded = g.Mul(g.Div(g.Add(width, g.constant(f"{x}_chunk_less_one", [chunk - 1], np.int64)), size), size)
    zeros = g.ConstantOfShape(g.Concat(g.Shape(x, start=0, end=1), g.Sub(padded, width), axis=0),
                              value=helper.make_tensor(f"{x}_zero", TensorProto.DOUBLE, [1], [0.0]))
    count = g.Div(padded, size)  # chunks a row: the shape given whole, so that a batch of no rows reshapes too
    chunks = g.Reshape(g.Concat(x, zeros, axis=1), g.Concat(g.Shape(x, start=0, end=1), count, size, axis=0))
    inner = g.CumSum(chunks, axis2)  # [B, W / chunk, chunk]
    totals = g.Gather(inner, g.constant(f"{x}_last", chunk - 1, np.int64), axis=2)  # each chunk's sum
    before = g.CumSum(totals, axis1, exclusive=1)
    sums = g.Reshape(g.Add(inner, g.Unsqueeze(before, g.constant(f"{x}_axes2", [2], np.int64))),
                     g.Concat(g.Shape(x, start=0, end=1), padded, axis=0))
    return g.Slice(sums, g.constant(f"{x}_from", [0], np.int64), width, g.constant(f"{x}_axes1", [1], np.int64))


def sampler_model(logits_type: int = TensorProto.FLOAT, distribution: bool = False) -> onnx.ModelProto:
    """The sampling graph (see the module) for logits of ``logits_type`` (float, float16 or bfloat16): inputs
    :data:`LOGITS` ``[B, vocab]``, :data:`PARAMETER_INPUTS` and :data:`SORT_WIDTH`; outputs :data:`TOKENS`,
    :data:`COMPLETE`, and with ``distribution`` :data:`DISTRIBUTION` (a row's where it is complete: for tests; the
    engine's graph leaves it out, as ONNX Runtime computes an output whether it is read or not)."""
    if logits_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
        raise ValueError("the sampler takes float, float16 or bfloat16 logits, got "
                         f"{TensorProto.DataType.Name(logits_type)}")
    g = _Graph()
    zero, one = g.constant("zero", 0.0, np.float64), g.constant("one", 1.0, np.float64)
    axis1, first, last = g.constant("axis1", [1], np.int64), g.constant("first", [0], np.int64), \
        g.constant("last", [-1], np.int64)
    i_zero, i_one = g.constant("i_zero", 0, np.int64), g.constant("i_one", 1, np.int64)
    column = lambda name: g.Unsqueeze(name, axis1)  # noqa: E731 - [B] -> [B, 1]
    row_sum = lambda x: g.ReduceSum(x, axis1, keepdims=1)  # noqa: E731
    count = lambda condition: g.ReduceSum(g.Cast(condition, to=TensorProto.INT64), axis1, keepdims=0)  # noqa: E731

    x = g.Cast(LOGITS, to=TensorProto.DOUBLE)
    greedy = g.Less("temperature", g.constant("greedy_below", GREEDY_BELOW, np.float64))
    temperature = column(g.Where(greedy, one, "temperature"))  # a greedy row's softmax is computed, then unused
    # within +-FINITE before and after the temperature, as the host (an infinite logit over a temperature near
    # FINITE is a small number there, and the row's other tokens keep some mass)
    low, high = g.constant("low", -FINITE, np.float64), g.constant("high", FINITE, np.float64)
    clipped = g.Clip(x, low, high)
    scaled = g.Clip(g.Div(clipped, temperature), low, high)
    q = g.Softmax(scaled, axis=1)
    width = g.Squeeze(g.Shape(q, start=1, end=2), first)  # the vocabulary, a scalar
    sort = g.Squeeze(SORT_WIDTH, first)
    # Only the sorted values are read, never TopK's indices: ONNX Runtime's CUDA TopK does not give tied values in
    # index order (its radix selection orders them by thread), where the host's stable sort does.
    values = g.node("TopK", [q, SORT_WIDTH], 2, axis=1, largest=1, sorted=1)[0]
    at = lambda position: g.GatherElements(values, column(position), axis=1)  # noqa: E731 - [B] -> [B, 1]
    # min-p and top-k keep the tokens at least as likely as a threshold: min_p times the most likely's probability,
    # and the k-th most likely's (0 where no top-k: every token)
    has_top_k = g.Greater("top_k", i_zero)
    kth = at(g.Sub(g.Min(g.Where(has_top_k, "top_k", i_one), sort), i_one))
    end = g.constant("end", [2**62], np.int64)
    most_likely = g.Slice(values, first, g.constant("one_i", [1], np.int64), axis1)
    threshold = g.Max(g.Mul(column("min_p"), most_likely), g.Where(column(has_top_k), kth, zero))
    kept = g.GreaterOrEqual(q, threshold)  # in token order, over the whole vocabulary
    kept_mass = row_sum(g.Where(kept, q, zero))
    # top-p: the sorted positions up to the first whose running mass (of what min-p and top-k left, renormalized)
    # reaches top_p. What those two keep is a prefix of the sorted tokens, whose mass reaches 1: the cut falls within
    # it (and `keep` drops what follows it anyway).
    cut = count(g.Less(_running_sums(g, g.Div(values, kept_mass), RUNNING_CHUNK), column("top_p")))
    # The nucleus is the first cut + 1 tokens of the stable order: every token more likely than the cut's, and of
    # those as likely as it, the first ones by index (counted in token order) to make up the number.
    last_kept = g.Min(cut, g.Sub(sort, i_one))
    edge = at(last_kept)
    above = g.Greater(q, edge)
    tied = g.Equal(q, edge)
    tie_rank = _running_sums(g, g.Cast(tied, to=TensorProto.DOUBLE), RUNNING_CHUNK)  # 1 at a row's first tie
    room = g.Cast(column(g.Sub(g.Add(last_kept, i_one), count(above))), to=TensorProto.DOUBLE)
    nucleus = g.Or(above, g.And(tied, g.LessOrEqual(tie_rank, room)))
    top_p = g.Less("top_p", one)
    keep = g.And(kept, g.Or(g.Not(column(top_p)), nucleus))
    # Incomplete: a nucleus whose mass the sorted tokens do not reach, where a token past them could join it (more
    # tokens of mass are kept than were sorted); a k-th token past them.
    could_join = g.Greater(count(g.And(kept, g.Greater(q, zero))), sort)
    g.nodes.append(helper.make_node("Not", [g.Or(g.And(top_p, g.And(g.GreaterOrEqual(cut, sort), could_join)),
                                                 g.And(has_top_k, g.Greater("top_k", sort)))], [COMPLETE]))
    chosen = g.Where(keep, q, zero)
    probs = g.Div(chosen, row_sum(chosen))
    running = _running_sums(g, probs, RUNNING_CHUNK)
    target = g.Mul(column("uniform"), g.Slice(running, last, end, axis1))
    # how many running sums are at most the target is the drawn token (none for a NaN row: token 0)
    drawn = g.Min(count(g.LessOrEqual(running, target)), g.Sub(width, i_one))
    g.nodes.append(helper.make_node("Where", [greedy, g.ArgMax(clipped, axis=1, keepdims=0), drawn], [TOKENS]))
    if distribution:
        g.nodes.append(helper.make_node("Where", [column(greedy), zero, probs], [DISTRIBUTION]))

    rows, columns = "rows", "vocab"
    inputs = [helper.make_tensor_value_info(LOGITS, logits_type, [rows, columns])]
    inputs += [helper.make_tensor_value_info(name, TensorProto.INT64 if name == "top_k" else TensorProto.DOUBLE,
                                             [rows]) for name in PARAMETER_INPUTS]
    inputs.append(helper.make_tensor_value_info(SORT_WIDTH, TensorProto.INT64, [1]))
    outputs = [helper.make_tensor_value_info(TOKENS, TensorProto.INT64, [rows]),
               helper.make_tensor_value_info(COMPLETE, TensorProto.BOOL, [rows])]
    if distribution:
        outputs.append(helper.make_tensor_value_info(DISTRIBUTION, TensorProto.DOUBLE, [rows, columns]))
    graph = helper.make_graph(g.nodes, "sampler", inputs, outputs, initializer=g.initializers)
    return helper.make_model(graph, ir_version=IR_VERSION, producer_name="kvcache-op",
                             opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)])


class Draws:
    """The uniforms of one step the graph samples: one per row whose request samples (``params[r]`` not greedy),
    from that request's own generator (``generators[r]``), as the host sampler draws them. Each generator's state
    before its draw is kept, so that a draw whose token goes unused (a prompt chunk with more of the prompt to come,
    a step that failed) can be taken back: the request then draws as if the step had not been."""

    def __init__(self, params: list, generators: list):
        self.uniforms = [0.0] * len(params)
        self._before = {}
        for r, (p, g) in enumerate(zip(params, generators)):
            if p is not None and not p.greedy:
                self._before[r] = g, g.bit_generator.state
                self.uniforms[r] = g.random()

    def take_back(self, rows=None) -> None:
        """Puts the generators of ``rows`` (default: every row) back as they were before this step's draws."""
        for r in self._before if rows is None else rows:
            if r in self._before:
                generator, state = self._before[r]
                generator.bit_generator.state = state
