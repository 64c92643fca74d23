"""The engine's online face: requests submitted from any thread while others run, stepped by one background
thread (continuous batching across calls), their tokens streamed to a :class:`RequestHandle` as they are chosen.

One lock serializes everything that touches the engine's state: a step of the background thread, the queueing of
a ``submit`` or of a :meth:`Engine.generate` batch (whose requests then run in the continuous batch like submitted
ones), and ``metrics()``. A step never runs concurrently with another, so the cache manager needs no locking of
its own.

The background thread holds the engine only while work is pending: an engine dropped without :meth:`close` is
collected once its requests are done (its cache, session and thread with it), as any Python object would be.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import threading
import time
import traceback
import weakref

from ..manager.identity import salt_bytes
from .sampling import SamplingParams

log = logging.getLogger("kvcache_op.serving")

_IDLE_LOOK_SECONDS = 5.0  # an idle background thread looks whether its engine is still referenced this often


class EngineBusy(RuntimeError):
    """``submit``'s refusal of a request while ``max_waiting`` submitted requests already wait for admission beyond
    the free running slots; ``waiting`` is their count (``backlog``)."""

    def __init__(self, waiting: int, max_waiting: int):
        super().__init__(waiting, max_waiting)  # the arguments: it pickles, as an error crossing processes must
        self.waiting, self.max_waiting = waiting, max_waiting

    def __str__(self) -> str:
        return f"{self.waiting} requests are waiting to be admitted (the limit is {self.max_waiting})"


class RequestHandle:
    """A submitted request. Iterating it yields its tokens as they are chosen (blocking); ``async for`` does
    the same without blocking an event loop; :meth:`result` waits for all of them; :meth:`cancel` stops it at
    the next step boundary and releases its pages. ``finish_reason``: ``"stop"`` (an end-of-sequence or stop
    id, included in the tokens), ``"length"`` (``max_tokens`` reached), ``"cancelled"`` or ``"error"`` (the
    step failed, or ``generate``'s ``on_token`` raised for it: :meth:`result` and iteration raise the exception);
    ``None`` while it runs."""

    def __init__(self, request_id, on_cancel=None, on_finish=None):
        self.request_id = request_id
        self.finish_reason = None
        self.submitted_at = time.perf_counter()  # time.perf_counter() clock, as token_times
        self._tokens = []
        self._times = []
        self._logprobs = []
        self._error = None
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel  # the engine's: ends a run of decode steps at its next step
        self._on_finish = on_finish  # told of the handle once, when it finishes (generate's wait for any)
        # result() waits on its own event, not on the condition every token notifies: a batch caller waiting for
        # whole results is then woken once per request, not once per token (each wake-up takes the GIL from the
        # engine's thread in the middle of its step)
        self._finished = threading.Event()
        self._changed = threading.Condition(threading.Lock())  # a plain lock: cheaper to take than an RLock
        self._watchers = []  # callables told of every change (the asyncio face's wake-ups)
        self._done_callbacks = []  # add_done_callback's, each called once when the request finishes
        self._waiting = 0  # threads waiting on _changed for a token (iteration)

    # ---- the engine's side ---------------------------------------------------------------------------------
    def _push(self, token: int, logprobs=None, when: float = None) -> None:
        """One more token, chosen at ``when`` (``time.perf_counter()``; default now).

        Without the lock (taking it costs ~10 us per token right after a model step, when its memory is cold):
        each append is atomic under the GIL, the token goes in after its time and logprobs (a reader that sees
        it finds them), and only then are readers looked for, while a reader registers (``_waiting``,
        ``_watchers``, under the lock) before it looks at the tokens. So the reader sees the token or the push
        sees the reader (and wakes it under the lock): no wake-up is lost."""
        self._times.append(time.perf_counter() if when is None else when)
        if logprobs is not None:
            self._logprobs.append(logprobs)
        self._tokens.append(token)
        if self._waiting:
            with self._changed:
                self._changed.notify_all()
        if self._watchers:
            for watcher in list(self._watchers):
                watcher()

    def _finish(self, reason: str, error: BaseException = None) -> None:
        with self._changed:
            first = self.finish_reason is None
            if first:
                self.finish_reason, self._error = reason, error
            self._finished.set()
            self._changed.notify_all()
            watchers = list(self._watchers)
            callbacks, self._done_callbacks = self._done_callbacks, []
        for watcher in watchers:
            watcher()
        for callback in callbacks:
            _call_quietly(callback, self)
        if first and self._on_finish is not None:
            self._on_finish(self)

    # ---- the caller's side ---------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True once the request finished (for any reason)."""
        return self.finish_reason is not None

    @property
    def tokens(self) -> list:
        """The tokens chosen so far (a copy)."""
        with self._changed:
            return list(self._tokens)

    @property
    def token_times(self) -> list:
        """When each token was chosen (``time.perf_counter()``; ``submitted_at`` on the same clock): time to first
        token and inter-token latencies without a consumer thread per request."""
        with self._changed:
            return list(self._times)

    def logprobs_of(self, index: int):
        """The :class:`~kvcache_op.serving.sampling.TokenLogprobs` of token ``index`` (None without
        ``SamplingParams.logprobs``): one entry, where :attr:`logprobs` copies them all."""
        with self._changed:
            return self._logprobs[index] if index < len(self._logprobs) else None

    @property
    def logprobs(self) -> list:
        """With ``SamplingParams.logprobs``: one :class:`~kvcache_op.serving.sampling.TokenLogprobs` per token so
        far (a copy); else empty."""
        with self._changed:
            return list(self._logprobs)

    def cancel(self) -> None:
        """Asks the engine to stop the request at the next step boundary (its pages are released then); the
        tokens chosen so far stay. Does nothing to a finished request (nor to the decode run of the others). Safe from
        any thread."""
        if self._finished.is_set():
            return
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel()

    def add_done_callback(self, callback) -> None:
        """Calls ``callback(handle)`` once the request has finished (its ``finish_reason`` and every token set): at
        once, in this thread, if it has; else in the engine's thread as the request finishes, so it must be quick
        and thread-safe. What it raises is logged and goes no further (the engine's step goes on)."""
        with self._changed:
            if self.finish_reason is None:
                self._done_callbacks.append(callback)
                return
        _call_quietly(callback, self)

    def _wait_beyond(self, count: int, timeout: float = None) -> tuple:
        """(tokens after the first ``count``, finished) once there are more tokens or the request is done."""
        with self._changed:
            self._waiting += 1
            try:
                arrived = self._changed.wait_for(lambda: len(self._tokens) > count or self.done, timeout)
            finally:
                self._waiting -= 1
            if not arrived:
                raise TimeoutError(f"request {self.request_id!r}: no token within {timeout} s")
            return self._tokens[count:], self.done

    def __iter__(self):
        seen = 0
        while True:
            new, finished = self._wait_beyond(seen)
            yield from new
            seen += len(new)
            if finished and not new:
                if self._error is not None:
                    raise self._error
                return

    async def __aiter__(self):
        # Woken from the engine's thread through the loop (call_soon_threadsafe), so a server streaming many
        # requests holds no thread per waiting request.
        loop, changed = asyncio.get_running_loop(), asyncio.Event()

        def wake():
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # the loop closed: nobody is listening any more
                pass

        with self._changed:
            self._watchers.append(wake)
        try:
            seen = 0
            while True:
                changed.clear()  # before looking: a change after the look sets it again
                with self._changed:
                    new, finished = self._tokens[seen:], self.done
                for token in new:
                    yield token
                seen += len(new)
                if finished and not new:
                    if self._error is not None:
                        raise self._error
                    return
                if not new:
                    await changed.wait()
        finally:
            with self._changed:
                self._watchers.remove(wake)

    def result(self, timeout: float = None) -> list:
        """Every token, once the request finished (``TimeoutError`` after ``timeout`` seconds; the request's
        own exception if its step failed). A cancelled request returns what it had."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
        with self._changed:
            if self._error is not None:
                raise self._error
            return list(self._tokens)


class OnlineEngine:
    """The online half of :class:`~kvcache_op.serving.Engine` (a mixin: it drives the engine's own ``_step``)."""

    def _init_online(self) -> None:
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._online_waiting = collections.deque()
        self._online_running = []
        self._online_ids = itertools.count()
        self._online_step = 0
        self._rolled_back = None  # the request ids of the step the engine last rolled back (while it steps)
        self._thread = None
        self._closed = False
        # The engine itself while queued work waits for the background thread to take it up (which then holds the
        # engine as it steps), else empty: queued requests keep a dropped engine alive until they are done. A list
        # the thread holds too, not a reference from the engine to itself, which the garbage collector would free.
        self._held_for_work = []
        # Collected while idle (the thread holds it only while work is pending): wake the thread so that it ends. Not
        # at the interpreter's exit, where a daemon thread in a step may hold the lock it would wait for.
        weakref.finalize(self, _wake, self._work).atexit = False
        # A run of decode steps planned at once holds the lock for many steps: it ends at its next step while a
        # caller waits for the lock (one entry each, taken back once it has it; the background thread lets such
        # callers take the lock before its next step) or a request was cancelled since the engine last looked
        # (cleared when it does). Deques: appending and popping are atomic.
        self._knocking = collections.deque()
        self._cancelling = collections.deque()
        self._knock_cancel = functools.partial(self._cancelling.append, None)

    def _interrupted(self) -> bool:
        """Whether a run of decode steps should end at this step (a caller waits for the engine's lock, or a request
        was cancelled)."""
        return bool(self._knocking or self._cancelling)

    @contextlib.contextmanager
    def _lock_soon(self):
        """The engine's lock, without waiting out a run of decode steps: the run ends at its next step, and the
        background thread does not start another before this caller has the lock."""
        self._knocking.append(None)
        waiting = True
        try:
            with self._lock:
                self._knocking.pop()  # holding the lock: no run is in progress to end
                waiting = False
                yield
        finally:
            if waiting:  # acquiring raised
                self._knocking.pop()

    def submit(self, prompt, params: SamplingParams = None, *, salt=None, max_waiting: int = None) -> RequestHandle:
        """Queues ``prompt`` (token ids) for generation with ``params`` (default: greedy, ``max_tokens`` 16) and
        returns its :class:`RequestHandle` at once; a background thread steps the engine while work is pending,
        batching it with whatever else runs. ``salt`` isolates the request's prefix cache. Everything is checked
        here (``ValueError``/``TypeError``); a request that could never fit is refused before it is queued. With
        ``max_waiting``, :class:`EngineBusy` refuses it while that many submitted requests wait for admission beyond
        the free running slots (:meth:`backlog`), counted under the lock that queues it (so concurrent callers can
        neither pass the limit together nor see each other twice). Safe from any thread."""
        if max_waiting is not None and (type(max_waiting) is not int or max_waiting < 0):
            raise ValueError(f"max_waiting must be None or an int >= 0, got {max_waiting!r}")
        params = self._sampling(params, 1)[0]  # its type and what this engine supports (a list of one is one)
        salt_bytes(salt)
        q = self._new_sequence(None, self._token_ids(prompt, "the prompt"), params.max_tokens, salt, 0, params)
        self._check_fits(q, params.max_tokens, "submitted request")
        with self._lock_soon():
            if self._closed:
                raise RuntimeError("the engine is closed")
            if max_waiting is not None and self.backlog(adding=1) > max_waiting:
                raise EngineBusy(self.backlog(), max_waiting)
            return self._enqueue_batch([q])[0]

    def _enqueue_batch(self, sequences: list, on_finish=None) -> list:
        """Queues checked sequences (their ``arrival``: steps after the engine's next step), each under a new
        request id with a new handle (``on_finish(handle)`` called once it finishes), in arrival order, and makes
        sure the background thread runs. Returns the handles."""
        with self._lock_soon():
            base = self._online_step
            for q in sequences:
                q.index = next(self._online_ids)
                q.arrival += base
                q.handle = RequestHandle(q.index, self._knock_cancel, on_finish)
                place = len(self._online_waiting)  # after everything arriving no later (usually: at the end)
                while place and self._online_waiting[place - 1].arrival > q.arrival:
                    place -= 1
                self._online_waiting.insert(place, q)
            self._held_for_work[:] = [self]
            if self._thread is None:
                self._thread = threading.Thread(target=_serve_while_referenced,
                                                args=(weakref.ref(self), self._held_for_work),
                                                name="kvcache-op-engine", daemon=True)
                self._thread.start()
            self._work.notify()
        return [q.handle for q in sequences]

    @property
    def queue_length(self) -> int:
        """Submitted requests waiting to be admitted (not yet running)."""
        return len(self._online_waiting)

    def backlog(self, adding: int = 0) -> int:
        """Submitted requests (and ``adding`` more) that would still wait once every free running slot
        (``max_running`` less those running) took one: what a queue limit counts. Requests the next step can admit
        are not a backlog, though admission also needs their pages."""
        return max(0, len(self._online_waiting) + adding - max(0, self.max_running - len(self._online_running)))

    @property
    def running_count(self) -> int:
        """Submitted requests running (admitted, not finished)."""
        return len(self._online_running)

    def close(self, timeout: float = None) -> None:
        """Cancels every submitted request still queued or running and stops the background thread (waiting up
        to ``timeout`` seconds for it; called on that thread, from a request's done callback, it does not wait for
        itself). ``generate`` still works afterwards (it starts the thread again); ``submit`` does not."""
        with self._lock_soon():
            self._closed = True
            for q in list(self._online_waiting) + self._online_running:
                q.handle.cancel()
            self._work.notify()
            thread = self._thread  # read once, under the lock: the thread sets it to None as it ends
        if thread is not None and thread is not threading.current_thread():  # from a done callback: it ends by itself
            thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        """Leaving a ``with Engine(...) as engine:`` block closes it (:meth:`close`)."""
        self.close()

    def _serve_until_idle(self) -> bool:
        """The background thread's work: one step at a time while submitted requests are pending. Returns when none
        is: True to wait for more, False when the engine is closed (the thread then ends)."""
        while True:
            # Callers waiting for the lock take it first: a lock is not fair, and this thread, which just let it
            # go, would otherwise take it back at once, run one more step (the knock ends the run) and again, for
            # as long as the waiting thread is not scheduled: hundreds of steps while it waited 50 ms).
            while self._knocking:
                time.sleep(50e-6)
            with self._lock:
                self._drop_cancelled()
                if not (self._online_waiting or self._online_running):
                    self._held_for_work.clear()  # under the lock: work queued after this holds the engine again
                    if self._closed:
                        self._thread = None
                        return False
                    return True
                if not self._online_running and self._online_waiting[0].arrival > self._online_step:
                    self._online_step = self._online_waiting[0].arrival  # nothing to run before the next arrival
                began, ran, self._rolled_back = time.perf_counter(), 1, None
                try:
                    ran = self._step(self._online_step, self._online_waiting, self._online_running)
                except BaseException as error:
                    self._fail_step(_without_engine_frames(error))
                self._online_step += ran
                self._times["wall"] += time.perf_counter() - began  # metrics(): busy time, as generate counts it

    def _fail_step(self, error: BaseException) -> None:
        """A step raised ``error``. Rolled back (``_rolled_back``: the requests it ran, moved back to the waiting
        line with their pages released), those requests fail and every other goes on: requests queued behind it or
        not scheduled in it are other callers'. A failure the roll-back did not reach (while admitting or
        planning, or in the roll-back itself) leaves the batch's state unknown: a step still outstanding is aborted, and
        every request fails and releases its pages."""
        failed = self._rolled_back
        if failed is not None:
            for q in [q for q in self._online_waiting if q.index in failed]:
                self._online_waiting.remove(q)
                q.handle._finish("error", error)
            return
        outstanding = self.manager.outstanding_plan
        if outstanding is not None:  # a step planned and never rolled back: the manager would refuse every next one
            try:
                self.manager.abort(outstanding)
            except Exception:  # noqa: BLE001 - as below: every request still gets its answer
                log.exception("the failed step could not be aborted: the cache manager may refuse later steps")
        for q in self._online_running:
            try:
                self.manager.finish(q.index)
            except Exception:  # noqa: BLE001 - a manager that failed already: every request still gets its answer
                log.exception("a failed step's request %s could not release its pages", q.index)
        for q in list(self._online_waiting) + self._online_running:
            q.handle._finish("error", error)
        self._online_waiting.clear()
        self._online_running.clear()

    def _drop_cancelled(self) -> None:
        """At a step boundary: cancelled requests leave, their pages released."""
        self._cancelling.clear()  # before looking: a cancellation after the look knocks again
        for q in [q for q in self._online_running if q.handle._cancelled.is_set()]:
            self.manager.finish(q.index)
            self._online_running.remove(q)
            q.handle._finish("cancelled")
        for q in [q for q in self._online_waiting if q.handle._cancelled.is_set()]:
            self._online_waiting.remove(q)
            q.handle._finish("cancelled")


def _call_quietly(callback, handle: RequestHandle) -> None:
    """A done callback's call: its failure is logged, not raised into the engine's step."""
    try:
        callback(handle)
    except Exception:  # noqa: BLE001 - a caller's callback; the step that finished the request goes on
        log.exception("a done callback of request %r failed", handle.request_id)


def _wake(work: threading.Condition) -> None:
    """An engine was collected: its background thread, waiting on ``work``, looks again (and ends)."""
    with work:
        work.notify_all()


def _without_engine_frames(error: BaseException) -> BaseException:
    """``error``, which the failed requests' handles keep, without its traceback and those of the errors it chains
    (their frames reach the engine, as each frame holds its caller): a handle kept after its engine was dropped
    would keep the engine alive. The traceback goes into the error's notes as text, so that where
    it was raised is still told wherever it is raised again."""
    if error.__traceback__ is not None:
        error.add_note("The engine's step raised it here:\n" +
                       "".join(traceback.format_tb(error.__traceback__.tb_next)).rstrip())
    seen, chain = set(), [error]
    while chain:
        link = chain.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        chain += [link.__cause__, link.__context__]
    return error


def _serve_while_referenced(engine_ref: weakref.ref, held_for_work: list) -> None:
    """The background thread's body. It holds the engine while requests are pending (so they finish though the
    caller dropped it: ``held_for_work`` holds it from their queueing until this thread takes them up) and waits
    for more through a weak reference alone: a thread that held an idle engine would keep it, its cache and its
    ONNX Runtime session alive for as long as the process runs."""
    while True:
        engine = engine_ref()
        if engine is None or not engine._serve_until_idle():
            return
        work, waiting, running = engine._work, engine._online_waiting, engine._online_running
        del engine
        with work:
            while not (waiting or running):
                engine = engine_ref()
                if engine is None or engine._closed:
                    break
                del engine  # not held while waiting: the engine's finalizer wakes this wait
                if engine_ref() is None:  # that was the last reference (its finalizer ran here, before any wait)
                    break
                # A finalizer run by a garbage collection inside wait() itself, before it listens, would go unheard:
                # look again now and then whatever happens.
                work.wait(_IDLE_LOOK_SECONDS)
            engine = None
