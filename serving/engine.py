"""Continuous batching of an exported decoder in ONNX Runtime, driven by the paged cache manager.

Every step: waiting requests join while pages allow; decodes (one token each) go first, then prefill
chunks of the remaining prompts under the step's token budget; the manager plans the step (page
tables, prefix hits, window releases, StreamingLLM discards); the graph runs it; the step is committed
only after the run succeeded; each sequence whose prompt is complete gets its greedy next token, and
requests that are done leave. When pages run out the most recently admitted request is preempted: its
pages are released and it is recomputed later from its prompt plus what it generated, so nothing is
lost (its published pages usually come back as prefix hits). Under StreamingLLM a prefill chunk never
crosses the request's page budget (``KVCacheManager.step_room``): its discards then happen at the same
points of its token stream however it was chunked, so a recomputed request holds exactly the cache it
held before, and its tokens do not depend on memory pressure or on the step's token budget.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time

import numpy as np

from ..manager import KVCacheManager, OutOfPages, StreamingPolicy
from ..manager.identity import check_int, salt_bytes
from ..manager.streaming import check_policy
from .online import OnlineEngine
from .ort_runner import ModelRunner
from .sampler_graph import Draws, graph_samplable, sampler_feeds
from .sampling import SamplingParams, choose_tokens
from .sequence import Sequence
from .step_feeds import NEXT_DECODE_CHANGES, next_decode_feeds, step_feeds
from .text import StopMatcher, TextStream

DEFAULT_BATCH_TOKENS = 256  # tokens fed per step on the CPU EP: decodes plus prefill chunks
# On a GPU a step's host work (ONNX Runtime's launches, each cache op's validation and index upload) costs about the
# same for 256 tokens as for thousands, and 256-token steps made a 64 x 1,000-token prefill 250 such steps. 8192 is
# the budget vLLM and SGLang default to for chunked prefill on large GPUs.
DEFAULT_DEVICE_BATCH_TOKENS = 8192
DEFAULT_RUNNING = 64  # requests in flight at once
DEFAULT_DECODE_STEPS = 64  # decode steps planned at once while every running request only decodes


def _nothing_refed(rid, n_new: int) -> int:
    """No StreamingLLM "reevaluate": a step feeds nothing again."""
    return 0


def _plain_greedy(sequences: list) -> bool:
    """Every one of ``sequences`` takes plain greedy tokens (no penalty, no logprobs) and keeps no logits: the graph
    can choose their tokens (:meth:`ModelRunner.run_greedy`)."""
    return all(q.params.plain_greedy and q.logits is None for q in sequences)


def _choose(out, chosen: bool, choosing: list) -> tuple:
    """(tokens, logprobs) of ``choosing``, one per row of ``out``: the tokens the graph chose where ``chosen``, else
    logits to choose from (:func:`~.sampling.choose_tokens`)."""
    if chosen:
        return out.tolist(), [None] * len(choosing)
    return choose_tokens(out, [q.params for q in choosing], [(q.prompt, q.generated) for q in choosing],
                         [q.generator for q in choosing])


def default_batch_tokens(device: str) -> int:
    """Tokens an engine feeds per step unless told: 256 on the CPU (``device`` ``"cpu"``), 8192 on a GPU."""
    return DEFAULT_BATCH_TOKENS if device == "cpu" else DEFAULT_DEVICE_BATCH_TOKENS


class Engine(OnlineEngine):
    """Serves the decoder exported by :func:`kvcache_op.hf.export_model` at ``model_path``.

    ``num_pages`` pages of the model's page size make the cache (allocated once, in ORT). ``providers``:
    ONNX Runtime execution providers (default: the CUDA EP when available, else the CPU EP).
    ``max_batch_tokens``: tokens fed per step (decodes and prefill chunks; default 256 on the CPU EP, 8192 on a GPU:
    :func:`default_batch_tokens`; at most the positions the graph's rotary tables hold, which ONNX Runtime's
    RotaryEmbedding cannot exceed in one step: a larger value is refused, the default lowered to it).
    ``max_running``: requests in flight at once (default 64). ``max_context``: longest context a
    request may reach (default the model's maximum positions); sets the page-table width. ``streaming``:
    a :class:`~kvcache_op.manager.StreamingPolicy` (StreamingLLM; ``"shift"`` rotates the kept keys with
    KeyCacheRotaryShift, ``"reevaluate"`` feeds them again). ``prefix_caching=False`` disables prefix
    reuse (pages are still paged). Layers sharing one sliding window release the pages before it.
    ``trace_steps`` keeps one record per step in ``step_trace`` (sequences, decodes, tokens, and the
    seconds spent scheduling, in ONNX Runtime and after the run). ``tokenizer`` (anything with
    ``decode(ids) -> str``, e.g. the checkpoint's ``AutoTokenizer``) lets requests stop at ``SamplingParams.stop``
    strings: a request ends with the token whose text completes one. ``decode_steps`` (default 64, at most a request's
    page table): while every running request only decodes, the manager plans that many steps at once (taking their
    pages), and each further step costs the host only its token choice and a few array additions; where every request
    takes plain greedy tokens (no penalty, no logprobs, no recorded logits) on the CPU EP, the graph chooses them and
    feeds the next step itself, and the host only hands the tokens over. A step that ends a request, a request due
    to arrive sooner, another caller queueing requests and a cancellation end the run early (at most one step
    later); pages taken for steps that did not run go back. 1 plans every step on its own. Not with a sliding window
    or StreamingLLM, whose pages move from step to step. The tokens are the same either way.
    """

    def __init__(self, model_path, *, num_pages: int, providers=None, max_batch_tokens: int = None,
                 max_running: int = None, max_context: int = None, streaming: StreamingPolicy = None,
                 prefix_caching: bool = True, intra_op_num_threads: int = 0, trace_steps: bool = False,
                 tokenizer=None, decode_steps: int = None):
        if max_batch_tokens is not None:
            max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens)
        max_running = DEFAULT_RUNNING if max_running is None else check_int("max_running", max_running)
        decode_steps = DEFAULT_DECODE_STEPS if decode_steps is None else check_int("decode_steps", decode_steps)
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        num_pages = check_int("num_pages", num_pages)
        if (max_batch_tokens is not None and max_batch_tokens < 1) or max_running < 1 or num_pages < 1:
            raise ValueError(f"num_pages, max_batch_tokens and max_running must be >= 1, got {num_pages}, "
                             f"{max_batch_tokens}, {max_running}")
        if providers is not None and (isinstance(providers, (str, bytes)) or not list(providers)):
            raise ValueError(f"providers must be a non-empty list of ONNX Runtime execution providers, got {providers!r}")
        if max_context is not None:
            max_context = check_int("max_context", max_context)
        if type(prefix_caching) is not bool:  # "no" would read as True
            raise TypeError(f"prefix_caching must be True or False, got {type(prefix_caching).__name__} "
                            f"{prefix_caching!r}")
        check_policy(streaming)  # read below before the manager is made
        intra_op_num_threads = check_int("intra_op_num_threads", intra_op_num_threads)
        if intra_op_num_threads < 0:
            raise ValueError(f"intra_op_num_threads must be >= 0 (0: ONNX Runtime's default), "
                             f"got {intra_op_num_threads}")
        self.runner = ModelRunner(model_path, num_pages, providers, intra_op_num_threads, max_batch_tokens)
        if max_batch_tokens is None:
            max_batch_tokens = default_batch_tokens(self.runner.device[0])
            if self.runner.step_token_limit is not None:
                max_batch_tokens = min(max_batch_tokens, self.runner.step_token_limit)
        info = self.info = self.runner.info
        ps = info.page_size
        window = info.uniform_window
        limit = info.max_positions if max_context is None else max_context
        if not 1 <= limit <= info.max_positions:
            raise ValueError(f"max_context must be in [1, the model's max_positions = {info.max_positions}], got {limit}")
        held = limit  # positions one request may hold in the cache: sets the page-table width
        if window is not None:  # only the window (and one step's tokens) is ever held
            held = min(held, window + max_batch_tokens + 2 * ps)
        if streaming is not None:  # StreamingLLM bounds what is held, not how long a request runs
            if streaming.mode == "shift" and not info.inv_freq:
                raise ValueError("StreamingLLM's key shift needs the model's rotary frequencies, and no single set "
                                 "moves this model's cached keys (its export found none): use "
                                 "StreamingPolicy(sinks, budget_pages, \"reevaluate\")")
            held, limit = streaming.budget_pages * ps, None
            if held > info.max_positions:  # cache positions run up to the budget: none may pass the model's
                raise ValueError(f"a StreamingLLM budget of {streaming.budget_pages} pages of {ps} holds {held} "
                                 f"positions, more than the model's max_positions = {info.max_positions}: give at "
                                 f"most {info.max_positions // ps} pages")
        # A "reevaluate" discard re-feeds what it keeps, at most half the budget's positions after the sinks: the
        # step's budget counts them (_feeds), and a step's first request fed over it stays within the budget's
        # positions, which the model's positions (its rotary tables) hold.
        self._reevaluates = streaming is not None and streaming.mode == "reevaluate"
        self.max_context = limit
        # A StreamingLLM step must fit the budget after dropping every page but the sinks.
        self._chunk_limit = ((streaming.budget_pages - -(-streaming.sinks // ps)) * ps if streaming is not None
                             else max_batch_tokens)
        self.manager = KVCacheManager(
            num_pages, ps, max(1, -(-held // ps)), sliding_window=window, streaming=streaming,
            vocab_size=info.vocab_size,
            cache_key=(info.cache_dtype, info.quant_bit, info.quant_group, info.cache_layout))
        self._held_pages = self.manager.max_pages  # the most pages one request ever holds
        # The fewest pages a request past its window or StreamingLLM budget must hold at once to go on, one token a
        # step (chunks halve down to one token while pages are short): the budget, or the pages a window's keys and
        # the token fed straddle (the manager keeps from page (computed - window + 1) // page_size on).
        self._steady_pages = (streaming.budget_pages if streaming is not None else
                              -(-(window - 1) // ps) + 1 if window is not None else None)
        self.num_pages = num_pages
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        # Decode steps planned at once: not with a window or StreamingLLM (their pages move from step to step), and
        # never more than a page table holds.
        self.decode_steps = (1 if window is not None or streaming is not None else
                             min(decode_steps, self.manager.max_pages * ps))
        self.prefix_caching = prefix_caching
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode(ids) method, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self._counters = collections.Counter()
        self._times = collections.Counter()
        self._peak_pages = 0
        self.step_trace = [] if trace_steps else None
        self.last_logits = self.last_logprobs = None
        self._last_call_lock = threading.Lock()  # a call's two written together, whatever others finish then
        self._init_online()

    # ---- public API ------------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int, salts=None, *, params=None, on_token=None, arrival_steps=None,
                 record_logits: bool = False) -> list:
        """Continuations of ``prompts`` (lists of token ids): ``max_new_tokens`` each, fewer when a request emits
        an end-of-sequence token (included) or one of its ``stop_token_ids``. ``params``: one
        :class:`SamplingParams` for every request or one per prompt (default: greedy; its ``max_tokens`` is
        ``max_new_tokens`` here); ``self.last_logprobs[i]`` holds what ``logprobs`` asks for, per token.
        ``salts[i]`` (str/bytes/None) isolates request ``i``'s prefix cache. ``on_token(i, token)`` streams each
        token as it is chosen; if it raises, the call cancels its other requests and raises that exception (the
        other callers' requests go on).
        ``arrival_steps[i]``: the step at which request ``i`` arrives, counted from the engine's next step (default
        all at once). ``record_logits``: also keep each chosen token's logits (``self.last_logits[i]``, one row per
        token). The batch call over :meth:`submit`: its requests join the continuous batch with whatever else runs
        (submitted requests, other threads' ``generate`` calls) and the call returns when all are done; safe from
        any thread. ``last_logprobs``/``last_logits`` are those of the call that finished last."""
        if threading.current_thread() is self._thread:  # an on_token callback: it would wait for steps only it runs
            raise RuntimeError("generate was called from the engine's own thread (an on_token callback, or another "
                               "callback of a step): it would wait for steps that only this thread runs; submit() "
                               "a request there instead, or call generate from another thread")
        count = len(prompts)
        for name, given in (("salts", salts), ("arrival_steps", arrival_steps)):
            if given is not None and (isinstance(given, (str, bytes)) or not hasattr(given, "__len__")):
                raise TypeError(f"{name} must be a list with one entry per prompt, got {type(given).__name__}")
        salts = [None] * count if salts is None else list(salts)
        arrivals = [0] * count if arrival_steps is None else [check_int("arrival_steps[i]", a) for a in arrival_steps]
        if len(salts) != count or len(arrivals) != count:
            raise ValueError(f"salts and arrival_steps need one entry per prompt ({count})")
        for i, salt in enumerate(salts):  # before any step: a late arrival's bad salt must not fail mid-run
            try:
                salt_bytes(salt)
            except (TypeError, ValueError) as error:
                raise type(error)(f"salts[{i}]: {error}") from None
        if any(a < 0 for a in arrivals):
            raise ValueError(f"arrival_steps must be >= 0, got {min(arrivals)}")
        max_new_tokens = check_int("max_new_tokens", max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        per_request = self._sampling(params, count)
        sequences = [self._new_sequence(None, self._token_ids(p, f"prompt {i}"), max_new_tokens, s, a, per_request[i])
                     for i, (p, s, a) in enumerate(zip(prompts, salts, arrivals))]
        for i, q in enumerate(sequences):
            self._check_fits(q, max_new_tokens, f"prompt {i}")
            if record_logits:
                q.logits = []
            if on_token is not None:
                q.on_token = functools.partial(on_token, i)
        finished = queue.SimpleQueue()  # the handles as they finish: a failure is acted on at once, in any order
        handles = self._enqueue_batch(sequences, on_finish=finished.put)
        try:
            for _ in handles:
                handle = finished.get()
                handle.result()  # a failed step's or its on_token's exception
                if handle.finish_reason == "cancelled":  # only close() cancels them: never a short answer
                    raise RuntimeError("the engine was closed while generate ran: its requests were cancelled")
        except BaseException:  # a failed step, its on_token, or an interrupted caller: nothing of it keeps running
            for handle in handles:
                handle.cancel()
            for handle in handles:  # gone at the engine's next step boundary: the call leaves no page behind it
                handle._finished.wait()
            raise
        with self._last_call_lock:  # not the stepping lock: that one would wait out others' decode runs
            self.last_logits = [q.logits for q in sequences] if record_logits else None
            self.last_logprobs = [q.logprobs for q in sequences]
        return [q.generated for q in sequences]

    def _new_sequence(self, index, prompt: list, max_new_tokens: int, salt, arrival: int,
                      params: SamplingParams) -> Sequence:
        """A request as the engine tracks it: its own random generator, and with stop strings (the engine has a
        tokenizer: checked with the params) the text stream that finds them."""
        q = Sequence(index, prompt, max_new_tokens, salt, arrival)
        q.params = params
        q.generator = np.random.default_rng(params.seed)
        q.ends = self.end_tokens(params)
        if params.stop:
            q.text_stream, q.stop_matcher = TextStream(self.tokenizer, prompt), StopMatcher(params.stop)
        return q

    def end_tokens(self, params: SamplingParams) -> frozenset:
        """The token ids that end a request of ``params``: its ``stop_token_ids`` and, unless ``ignore_eos``, the
        model's end-of-sequence ids (a set: looked up on every token, however many stop ids a request names)."""
        return frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.info.eos_token_ids)

    @property
    def _holds_whole_contexts(self) -> bool:
        """Whether a request holds a page for every position it fills (no sliding window, no StreamingLLM)."""
        return self.manager.sliding_window is None and self.manager.streaming is None

    @property
    def usable_context(self) -> int:
        """Positions one request may fill (prompt and generated tokens): ``max_context`` (the model's maximum
        positions by default) and, where a request holds a page for every position but its last token's (which is
        never fed back), what the page pool holds. Under StreamingLLM, the model's maximum positions."""
        context = self.max_context or self.info.max_positions
        if self._holds_whole_contexts:
            context = min(context, self.num_pages * self.info.page_size + 1)
        return context

    def _check_fits(self, q: Sequence, max_new_tokens: int, name: str) -> None:
        """``ValueError`` for a request that could never run: past the context limit, or needing more pages than the
        pool has (every page of its context; with a window or StreamingLLM, no more than the pages it must hold at
        once). Refused before any of its tokens, not after some were streamed."""
        if self.max_context is not None and len(q.prompt) + max_new_tokens > self.max_context:
            raise ValueError(f"{name}: {len(q.prompt)} tokens + max_new_tokens={max_new_tokens} exceed the context "
                             f"limit of {self.max_context} positions (max_context, at most the model's maximum "
                             f"positions)")
        ps = self.info.page_size
        needed = -(-(len(q.prompt) + max_new_tokens - 1) // ps)
        held = "" if self._holds_whole_contexts else " at once"
        if not self._holds_whole_contexts:
            needed = min(needed, self._steady_pages)
        if needed > self.num_pages:
            raise ValueError(f"{name}: {len(q.prompt)} tokens + max_new_tokens={max_new_tokens} need {needed} pages "
                             f"of {ps}{held}, more than num_pages={self.num_pages}: give the engine more pages")

    def _token_ids(self, prompt, name: str) -> list:
        """``prompt`` as a list of ints in ``[0, vocab)``; ``ValueError``/``TypeError`` naming the prompt (``name``)
        before any work (a float or bool id is refused, not truncated)."""
        ids = np.asarray(prompt)
        if ids.dtype == object and ids.ndim == 1 and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            # Python ints (numpy keeps them as objects when one is beyond int64): judged as ints
            first = next((i for i, t in enumerate(ids) if not 0 <= t < self.info.vocab_size), None)
            if first is not None:
                raise ValueError(f"{name}: token {ids[first]} at index {first} is outside the vocabulary "
                                 f"[0, {self.info.vocab_size})")
            ids = ids.astype(np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"{name} must be a non-empty list of token ids, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name}: token ids must be integers, got {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.info.vocab_size))
        if bad.size:
            raise ValueError(f"{name}: token {int(ids[bad[0]])} at index {int(bad[0])} is outside the "
                             f"vocabulary [0, {self.info.vocab_size})")
        return ids.astype(np.int64).tolist()

    def metrics(self) -> dict:
        """Counters since the engine was made: prefix hits, evictions, preemptions, tokens, pages, cache bytes,
        throughput, and where the time went (scheduling = admission, manager and feed building; ort_run =
        the graph and key shifts; other = sampling and the rest). Safe from any thread."""
        with self._lock_soon():  # a consistent picture from any thread: not in the middle of a step (a run ends)
            return self._metrics()

    def _metrics(self) -> dict:
        m = self.manager.metrics()
        t = self._times
        generated = self._counters["generated_tokens"]
        return {
            "prefix_hit_rate": m["hit_rate"], "prefix_hit_tokens": m["hit_tokens"],
            "prompt_tokens": m["queried_tokens"], "evictions": m["evictions"],
            "preemptions": self._counters["preemptions"], "generated_tokens": generated,
            "steps": self._counters["steps"], "fed_tokens": self._counters["fed_tokens"],
            "tokens_per_s": generated / t["wall"] if t["wall"] else 0.0,
            "pages_total": self.num_pages, "pages_in_use": m["pages_in_use"], "pages_cached": m["pages_cached"],
            "peak_pages_in_use": self._peak_pages, "cache_bytes": self.runner.cache_bytes,
            "time_scheduling_s": t["scheduling"], "time_ort_run_s": t["ort_run"],
            "time_other_s": max(0.0, t["wall"] - t["scheduling"] - t["ort_run"]), "wall_s": t["wall"],
            "providers": list(self.runner.providers),
        }

    # ---- one step --------------------------------------------------------------------------------------
    def _step(self, step: int, waiting, running: list) -> int:
        """One step (or a run of decode steps planned at once); returns how many steps ran (at least 1)."""
        began = time.perf_counter()
        self._admit(step, waiting, running)
        planned = self._plan(step, waiting, running) if running else None
        if planned is None:
            self._times["scheduling"] += time.perf_counter() - began
            return 1
        plan, sequences, steps = planned
        try:  # planned: from here a failure rolls the step back, or the manager would refuse every later step
            stepper = self._greedy_stepper(sequences, steps)
        except BaseException:
            self._roll_back(plan, waiting, running)
            raise
        if stepper is not None:
            return self._greedy_decode_steps(stepper, plan, sequences, steps, waiting, running, began)
        try:
            feeds = step_feeds(plan)
            scheduled = time.perf_counter()
            self._times["scheduling"] += scheduled - began
            if plan.shift_slots.size:
                self.runner.shift_keys(plan.shift_slots, plan.shift_deltas)
            chosen_in_graph, run = self._runner_call(sequences)
            out, draws = run(feeds)
        except BaseException:
            self._roll_back(plan, waiting, running)
            raise
        ran = time.perf_counter()
        self._times["ort_run"] += ran - scheduled
        self._peak_pages = max(self._peak_pages, self.num_pages - self.manager.pool.available())
        if steps > 1:
            return self._decode_steps(plan, feeds, sequences, steps, out, (chosen_in_graph, run), waiting, running,
                                      (began, scheduled, ran))
        self.manager.commit(plan)
        self._count_step(plan)
        rows, choosing = self._choosers(sequences)
        if draws is not None and rows is not None:  # prompt chunks with more to come: their draws go unused
            draws.take_back(set(range(len(sequences))).difference(rows))
        chosen = out if rows is None else out[rows]  # decode steps: every row, no copy
        tokens, logprobs = _choose(chosen, chosen_in_graph, choosing)
        self._retire(self._take_tokens(choosing, tokens, logprobs, None if chosen_in_graph else out, rows), running)
        self._trace(plan, feeds, (began, scheduled, ran))
        return 1

    def _decode_steps(self, plan, feeds: dict, sequences: list, steps: int, out, call: tuple, waiting,
                      running: list, times: tuple) -> int:
        """Runs up to ``steps`` decode steps the manager planned at once, the first of which just ran (``feeds``;
        ``out``: its logits, or its tokens where the graph chose them; ``call``: :meth:`_runner_call`'s for
        ``sequences``):
        each step's tokens are chosen and handed over, then :meth:`KVCacheManager.advance` gives the next step's
        plan; a step that ends a request ends the run. The steps that ran are committed together (also when handing
        tokens over raised), then the requests that are done leave. Returns how many steps ran."""
        for q in sequences:
            q.ran = True
        count, stopped = 0, []
        try:
            while True:
                count += 1
                self._count_step(plan)
                tokens, logprobs = _choose(out, call[0], sequences)
                stopped = self._take_tokens(sequences, tokens, logprobs, None if call[0] else out, None)
                self._trace(plan, None, times)
                if stopped or count == steps or self._interrupted():
                    break
                began = scheduled = time.perf_counter()
                try:
                    plan = self.manager.advance(plan, tokens)
                    feeds = next_decode_feeds(feeds, plan)
                    scheduled = time.perf_counter()
                    out, _ = call[1](feeds, NEXT_DECODE_CHANGES)
                except BaseException:
                    failed, plan = plan, None  # nothing to commit, whatever the roll-back raises
                    self._roll_back(failed, waiting, running)  # every planned step: the requests are recomputed
                    raise
                self._times["scheduling"] += scheduled - began
                times = (began, scheduled, time.perf_counter())
                self._times["ort_run"] += times[2] - scheduled
        finally:
            if plan is not None:  # what ran stays, whatever raised after it ran
                began = time.perf_counter()
                self.manager.commit(plan)
                self._times["scheduling"] += time.perf_counter() - began
        self._retire(stopped, running)
        return count

    def _runner_call(self, sequences: list) -> tuple:
        """(chosen, run) for a step of ``sequences``: ``run(feeds, changed=None)`` runs it and returns ``(out,
        draws)``, ``out`` the tokens the graph chose where ``chosen`` (every request plain greedy; or, where the
        runner samples in the graph, none with penalties or logprobs and none keeping logits), else the logits;
        ``draws``: the step's :class:`~.sampler_graph.Draws` where the graph sampled, else None."""
        if _plain_greedy(sequences):
            return True, lambda feeds, changed=None: (self.runner.run_greedy(feeds, changed), None)
        if self.runner.graph_sampling and all(graph_samplable(q.params) and q.logits is None for q in sequences):
            return True, functools.partial(self._run_sampled, sequences)
        return False, lambda feeds, changed=None: (self.runner.run(feeds, changed), None)

    def _run_sampled(self, sequences: list, feeds: dict, changed=None) -> tuple:
        """(tokens, draws) of a step the sampling graph chooses, each sampled request drawing its uniform from its
        own generator: a failed run takes the draws back, so a request draws as if the step had not been."""
        params = [q.params for q in sequences]
        draws = Draws(params, [q.generator for q in sequences])
        try:
            sampling = sampler_feeds(params, draws.uniforms, self.runner.info.vocab_size)
            return self.runner.run_sampled(feeds, sampling, changed), draws
        except BaseException:
            draws.take_back()
            raise

    def _greedy_stepper(self, sequences: list, steps: int):
        """The runner's :class:`~.greedy_steps.GreedySteps` when ``steps`` > 1 decode steps were planned at once for
        ``sequences`` that all take plain greedy tokens (no penalty, no logprobs) and keep no logits; else None (and
        on a device EP)."""
        if steps < 2 or not _plain_greedy(sequences):
            return None
        return self.runner.greedy_steps()

    def _greedy_decode_steps(self, stepper, plan, sequences: list, steps: int, waiting, running: list,
                             began: float) -> int:
        """Runs up to ``steps`` steps the manager planned at once (``plan``: the first, a decode step or a step
        ending prompts that leads the decode steps) through ``stepper``: the graph chooses each step's tokens and
        feeds the next step itself, and the host only hands each step's tokens over; a step that ends a request ends
        the run. Then the manager advances through the steps that ran
        and commits them (also when handing tokens over raised) and the requests that are done leave; a failed run
        rolls every planned step back (the requests are recomputed), as :meth:`_decode_steps` does. The same tokens
        as that loop's. Returns how many steps ran."""
        try:
            feeds = step_feeds(plan)
            if plan.decode_base is None:
                stepper.start(feeds)
            else:  # the plan's step (prompts' last chunks) leads, and its chosen tokens feed the decode step after it
                stepper.start(step_feeds(plan.next_decode(plan.decode_base.input_ids)), feeds)
        except BaseException:
            self._roll_back(plan, waiting, running)
            raise
        for q in sequences:
            q.ran = True
        scheduled = time.perf_counter()
        none, chosen, times, stopped = [None] * len(sequences), [], [], []
        try:
            while True:
                before = time.perf_counter()
                try:
                    ids = stepper.step()
                except BaseException:
                    chosen = None  # nothing to commit, whatever the roll-back raises
                    self._roll_back(plan, waiting, running)
                    raise
                times.append((before, time.perf_counter()))
                tokens = ids.tolist()
                chosen.append(tokens)
                stopped = self._take_tokens(sequences, tokens, none, None, None)
                if stopped or len(chosen) == steps or self._interrupted():
                    break
        finally:
            if chosen:  # what ran stays, whatever raised after it ran
                self._settle_greedy_steps(plan, int(feeds["decoding_batches"]), chosen, times, began, scheduled)
        self._retire(stopped, running)
        return len(chosen)

    def _settle_greedy_steps(self, plan, decodes: int, chosen: list, times: list, began: float,
                             scheduled: float) -> None:
        """The manager advances through the greedy decode steps that ran (``chosen[j]``: step j's tokens, fed to step
        j + 1; ``times[j]``: when its run began and ended; ``decodes``: the first step's one-token sequences) and
        commits them; each is counted (and traced) as a step of its own, and the time outside the runs is host time."""
        self._peak_pages = max(self._peak_pages, self.num_pages - self.manager.pool.available())
        first, count = plan, len(plan.request_ids)
        fed = int(first.seqstarts[-1])  # the first step's (a leading one feeds more than one token a sequence)
        self._counters["steps"] += len(chosen)
        self._counters["fed_tokens"] += fed + (len(chosen) - 1) * count
        self.manager.commit(plan, chosen[:-1] if len(chosen) > 1 else None)
        if self.step_trace is not None:
            done = [before for before, _ in times[1:]] + [time.perf_counter()]
            for j, (before, after) in enumerate(times):  # each step gathers one key more per sequence
                self._record_step(count, decodes if j == 0 else count, fed if j == 0 else count,
                                  int(first.kvstarts[-1]) + j * count,
                                  (began if j == 0 else before, before, after, done[j]))
        run = sum(after - before for before, after in times)
        self._times["ort_run"] += run
        self._times["scheduling"] += time.perf_counter() - began - run

    def _steps_ahead(self, step: int, waiting, running: list) -> int:
        """How many decode steps to plan at once: ``decode_steps``, fewer when a request has fewer tokens to go
        or a request arrives sooner (it is admitted at the step it arrives, as with one step at a time)."""
        steps = self.decode_steps
        if steps == 1:
            return 1
        for q in running:
            steps = min(steps, q.max_new_tokens - len(q.generated))
        if waiting and waiting[0].arrival > step:
            steps = min(steps, waiting[0].arrival - step)
        return max(steps, 1)

    def _count_step(self, plan) -> None:
        self._counters["steps"] += 1
        self._counters["fed_tokens"] += int(plan.seqstarts[-1])

    def _trace(self, plan, feeds, times: tuple) -> None:
        """Counts the host work since the run ended (``times``: when the step began, was scheduled and had run) and,
        with ``trace_steps``, keeps the step's record in ``step_trace``."""
        if self.step_trace is not None:
            began, scheduled, ran = times
            done = time.perf_counter()
            self._times["scheduling"] += done - ran  # commit, choosing and finishing are host work
            decodes = len(plan.request_ids) if feeds is None else int(feeds["decoding_batches"])
            self._record_step(len(plan.request_ids), decodes, int(plan.seqstarts[-1]), int(plan.kvstarts[-1]),
                              (began, scheduled, ran, done))
        else:
            self._times["scheduling"] += time.perf_counter() - times[2]

    def _record_step(self, sequences: int, decodes: int, tokens: int, kv_tokens: int, times: tuple) -> None:
        """Keeps one step's record in ``step_trace``; ``times``: when the step began, its run began and ended, and
        the host work after it was done."""
        began, run_began, ran, done = times
        self.step_trace.append(dict(sequences=sequences, decodes=decodes, tokens=tokens, kv_tokens=kv_tokens,
                                    scheduling_s=run_began - began, ort_run_s=ran - run_began, after_run_s=done - ran))

    def _choosers(self, sequences: list) -> tuple:
        """(rows, sequences) of the step's sequences that choose a token: decodes, and prefills whose prompt is
        now complete (a chunk with prompt tokens still to come predicts a prompt token). ``rows`` None: every
        row (a step of decodes and final chunks only)."""
        has_pending = self.manager.has_pending_tokens
        rows = []
        for row, q in enumerate(sequences):
            q.ran = True
            if q.next_input is not None or not has_pending(q.index):  # a decode never has prompt tokens left
                rows.append(row)
        if len(rows) == len(sequences):
            return None, sequences
        return rows, [sequences[row] for row in rows]

    def _take_tokens(self, choosing: list, tokens: list, logprobs, logits, rows) -> list:
        """Hands each chosen token to its request (its list, handle, callbacks); returns ``(request, reason, error)``
        of the requests that are done: an end-of-sequence or stop token, a stop string, ``max_new_tokens`` reached, or
        an ``on_token`` or a tokenizer decoding its text for stop strings that raised (:meth:`_retire` lets them leave
        once the step is committed)."""
        stopped = []
        now = time.perf_counter()  # one choice time for the step's tokens
        for i, (q, token, top) in enumerate(zip(choosing, tokens, logprobs)):
            q.generated.append(token)
            if top is not None:
                q.logprobs.append(top)
            q.next_input = [token]
            q.handle._push(token, top, now)
            self._counters["generated_tokens"] += 1  # per token handed over
            if q.logits is not None:
                q.logits.append(logits[i if rows is None else rows[i]].copy())
            if q.on_token is not None:
                try:
                    q.on_token(token)
                except Exception as error:  # the caller's own callback: its request fails, the batch goes on
                    stopped.append((q, "error", error))
                    continue
            stops = token in q.ends
            if q.stop_matcher is not None:  # stop strings: the text this token completes
                try:
                    stops = q.stop_matcher.feed(q.text_stream.push(token))[1] or stops
                except Exception as error:  # the tokenizer failed on this request's tokens: it fails, not the batch
                    stopped.append((q, "error", error))
                    continue
            if stops or len(q.generated) >= q.max_new_tokens:
                stopped.append((q, "stop" if stops else "length", None))
        return stopped

    def _retire(self, stopped: list, running: list) -> None:
        """The requests that are done leave: their pages are released and their handles finish."""
        for q, reason, error in stopped:
            self.manager.finish(q.index)
            running.remove(q)
            q.handle._finish(reason, error)

    def _admit(self, step: int, waiting, running: list) -> None:
        """Admits arrived requests in order while the running set and the free pages allow: a request
        joins when the pages it will hold (its context, or its window) fit next to those of the requests
        admitted before it in this step and one spare page per running request. A request sharing full pages
        of context with a running request that has not computed them yet waits for it (it is passed over, not
        blocking the others): requests that arrive together then share their common prefix instead of all
        computing it, since those pages are published once computed and matched on admission."""
        ps, reserved = self.info.page_size, 0
        if not (waiting and waiting[0].arrival <= step and len(running) < self.max_running):
            return  # nobody to admit (most decode steps): no leaders to look for
        leaders = collections.defaultdict(list)  # first full page -> running requests still computing prompts
        for q in running:
            self._note_leader(q, leaders)
        deferred = []
        while waiting and waiting[0].arrival <= step and len(running) < self.max_running:
            q = waiting[0]
            if self._waits_for_a_leader(q, leaders):
                deferred.append(waiting.popleft())
                continue
            needed = min(-(-len(q.context) // ps), self._held_pages)
            if running and needed + reserved + len(running) > self.manager.pool.available():
                break
            reserved += needed  # pages are taken at schedule time: count this step's admissions
            if not self.prefix_caching:
                self.manager.reset_prefix_cache()
            self.manager.add_request(q.index, q.context, q.salt)
            waiting.popleft()
            q.admissions += 1
            q.ran = False
            q.next_input = None
            running.append(q)
            self._note_leader(q, leaders)
        waiting.extendleft(reversed(deferred))  # back in their places, first in line

    def _first_page(self, q: Sequence):
        """What identifies a request's first full page of context (its salt and tokens), or None when it has
        none to share (prefix caching off, StreamingLLM, or a context shorter than a page and one token). Read
        from the prompt (and the first generated tokens of a short one) without building the context."""
        ps = self.info.page_size
        if not self.prefix_caching or self.manager.streaming is not None or \
                len(q.prompt) + len(q.generated) <= ps:
            return None
        first = q.prompt[:ps] if len(q.prompt) >= ps else q.prompt + q.generated[:ps - len(q.prompt)]
        return salt_bytes(q.salt), tuple(first)

    def _note_leader(self, q: Sequence, leaders: dict) -> None:
        """Records a running request that still has prompt tokens to compute under its first page (decodes,
        most of a step's requests, are passed over before their key is built)."""
        if self.manager.has_pending_tokens(q.index):
            key = self._first_page(q)
            if key is not None:
                leaders[key].append(q)

    def _waits_for_a_leader(self, q: Sequence, leaders: dict) -> bool:
        """Whether ``q`` shares full pages with a leader that has not computed them yet (they are published
        when it has, and ``q`` then matches them instead of computing them itself)."""
        if not leaders:  # the common case: nobody is computing a prompt
            return False
        key = self._first_page(q)
        if key is None or key not in leaders:
            return False
        ps, mine = self.info.page_size, np.asarray(q.context)
        for leader in leaders[key]:
            theirs = np.asarray(leader.context[:len(mine)])
            differ = np.flatnonzero(theirs != mine[:len(theirs)])
            common = int(differ[0]) if differ.size else len(theirs)
            if self.manager.computed(leader.index) < common // ps * ps:
                return True
        return False

    def _feeds(self, running: list, chunk_limit: int) -> dict:
        """Decodes first (so ``decoding_batches`` counts them), then prefill chunks of at most ``chunk_limit``
        tokens, within the token budget. The budget counts every token the step runs: those a StreamingLLM
        "reevaluate" discard feeds again too (decodes that re-feed go first, and the step's first request is fed
        whatever it re-feeds, within the StreamingLLM budget's positions; a request left without room waits a
        step)."""
        budget, feeds = self.max_batch_tokens, {}
        refed = self.manager.refed_tokens if self._reevaluates else _nothing_refed
        decoding = [(1 + refed(q.index, 1), q) for q in running if q.next_input is not None]
        if self._reevaluates:  # re-feeding ones first: never left out for others' decodes
            decoding.sort(key=lambda entry: entry[0] == 1)
        for cost, q in decoding:
            if budget > 0 and (cost <= budget or not feeds):
                feeds[q.index] = q.next_input
                budget -= cost
        for q in running:
            if q.next_input is None and budget > 0:
                limit = min(budget, chunk_limit)
                if self.manager.streaming is not None:  # StreamingLLM discards at stream positions, not chunk edges
                    limit = min(limit, self.manager.step_room(q.index))
                again = refed(q.index, limit)
                if again:  # what the discard re-feeds comes out of the chunk
                    if again + 1 > budget and feeds:
                        continue
                    limit = max(1, min(limit, budget - again))
                    again = refed(q.index, limit)
                chunk = self.manager.pending_tokens(q.index)[:limit]
                feeds[q.index] = chunk
                budget -= len(chunk) + again
        return feeds

    def _plan(self, step: int, waiting, running: list):
        """(the manager's plan of this step, its sequences in the plan's order, how many decode steps it plans).
        While pages are short, prefill chunks are halved first (a chunk needs pages only for what it feeds), then
        decode steps are planned one at a time, then the most recently admitted requests are preempted. ``None``
        when nothing can be fed. A step of decodes alone (most steps) is planned by ``schedule_decode``: the same
        plan, without a dict and a list per request, and ``steps`` of them at once. A step that ends every prompt it
        feeds may lead greedy decode steps (:meth:`_leads_greedy_steps`): it is planned with them, as one run."""
        chunk_limit, steps, leading = self._chunk_limit, None, None
        while running:
            decodes_only = len(running) <= self.max_batch_tokens and all(q.next_input is not None for q in running)
            if decodes_only and self._reevaluates:  # discards re-feed kept tokens: the budget may not hold them all
                decodes_only = sum(1 + self.manager.refed_tokens(q.index, 1) for q in running) <= self.max_batch_tokens
            if decodes_only and steps is None:  # only a step of decodes alone plans several
                steps = self._steps_ahead(step, waiting, running)
            feeds = None if decodes_only else self._feeds(running, chunk_limit)
            if not decodes_only and not feeds:
                return None
            if not decodes_only and leading is None:  # or one that ends every prompt, where greedy steps follow it
                leading = self._leads_greedy_steps(step, waiting, running, feeds)
                steps = self._steps_ahead(step, waiting, running) if leading else 1
            try:
                if decodes_only:
                    tokens = np.fromiter((q.next_input[0] for q in running), np.int64, len(running))
                    return self.manager.schedule_decode([q.index for q in running], tokens, steps), list(running), steps
                plan = self.manager.schedule(feeds, steps)
                by_id = {q.index: q for q in running}
                return plan, [by_id[rid] for rid in plan.request_ids], steps
            except OutOfPages:
                if steps > 1:  # fewer steps take fewer pages
                    steps = 1 if steps <= self.info.page_size or not decodes_only else self.info.page_size
                    continue
                longest = 1 if decodes_only else max(len(tokens) for tokens in feeds.values())
                if longest > 1:
                    chunk_limit = longest // 2
                    continue
                if len(running) == 1:
                    q = running[0]
                    raise RuntimeError(f"request {q.index} ({len(q.context)} tokens of context) does not fit "
                                       f"num_pages={self.num_pages} pages of {self.info.page_size}: give the "
                                       f"engine more pages") from None
                self._preempt(running.pop(), waiting)
        return None

    def _leads_greedy_steps(self, step: int, waiting, running: list, feeds: dict) -> bool:
        """Whether a step of ``feeds`` (prompts' chunks, and decodes) should be planned with the greedy decode steps
        after it, as one run: every running request is fed, each chunk ends its prompt, every request takes
        plain greedy tokens on a runner with greedy steps, and no arrived request waits but for a place among the
        running ones (a place frees when a request ends, which ends the run; but one waiting for a prefix this step
        computes would only be admitted once the run is committed, which publishes it)."""
        if self.decode_steps == 1 or len(feeds) != len(running) or \
                (waiting and waiting[0].arrival <= step and len(running) < self.max_running):
            return False
        pending = self.manager.pending_tokens
        if not all(q.next_input is not None or len(feeds[q.index]) == len(pending(q.index)) for q in running):
            return False
        return self._greedy_stepper(running, 2) is not None

    def _sampling(self, params, count: int) -> list:
        """One :class:`SamplingParams` per request from ``params`` (None: greedy; one for all; or one per prompt)."""
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            params = [params] * count
        params = list(params)
        if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"params must be a SamplingParams or a list of {count} (one per prompt)")
        if any(p.stop for p in params) and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: make the engine with tokenizer=..., or use stop_token_ids")
        return params

    def _preempt(self, q: Sequence, waiting) -> None:
        """Releases ``q``'s pages and puts it first in line; it is recomputed from its context later."""
        self.manager.finish(q.index)
        q.next_input = None
        if q.ran:
            self._counters["preemptions"] += 1
        waiting.appendleft(q)

    def _roll_back(self, plan, waiting, running: list) -> None:
        """The run failed: the step is aborted and its requests recomputed later (part of the step may
        have been written: an early layer, or a key shift), as the manager prescribes."""
        self.manager.abort(plan)
        scheduled = set(plan.request_ids)
        for q in [q for q in running if q.index in scheduled][::-1]:
            self._preempt(q, waiting)  # first: should it raise, q is still running, where a failure finds it
            running.remove(q)
        self._rolled_back = frozenset(scheduled)  # whom the failure concerns: the rest of the batch is intact

