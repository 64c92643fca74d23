"""``GET /metrics``: Prometheus text from prometheus-client, one registry per server (so several apps in one
process do not collide). Request, token and latency figures are counted as requests finish; the engine's state
(pages, queue, prefix hits) is read from :meth:`Engine.metrics` at each scrape. Replicas behind one address (Ray
Serve) answer every replica's series, each labelled with its replica (:func:`merged_text`)."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvcache_op.server")
PREFIX = "kvcache_op_"
# Latency buckets (seconds) from a fast CPU decode step to a long queue wait.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineState:
    """A collector reading the engine's counters and gauges once per scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        m, engine = self.engine.metrics(), self.engine
        gauges = (("pages_in_use", "cache pages held by requests", m["pages_in_use"]),
                  ("pages_total", "cache pages in the pool", m["pages_total"]),
                  ("pages_cached", "pages kept for prefix reuse", m["pages_cached"]),
                  ("prefix_hit_rate", "share of prompt tokens served from the prefix cache", m["prefix_hit_rate"]),
                  ("queue_length", "requests waiting to be admitted", engine.queue_length),
                  ("running_requests", "requests running", engine.running_count))
        for name, text, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, text, value=value)
        counters = (("prefix_hit_tokens", "prompt tokens served from the prefix cache", m["prefix_hit_tokens"]),
                    ("fed_tokens", "tokens fed to the model", m["fed_tokens"]),
                    ("engine_steps", "engine steps run", m["steps"]),
                    ("preemptions", "requests preempted for pages", m["preemptions"]))
        for name, text, value in counters:
            yield CounterMetricFamily(PREFIX + name, text, value=value)


class _Families:
    """A registry-like source of already built metric families, for ``generate_latest``."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merged_text(texts, labels: list = None, reporting: bool = False) -> bytes:
    """One exposition of the series of several exposition ``texts`` (each family once, every text's samples in it),
    the samples of ``texts[i]`` labelled with ``labels[i]`` where given; with ``reporting``, also the gauge
    ``kvcache_op_replicas_reporting``: how many texts there are."""
    families = {}
    for index, text in enumerate(texts):
        extra = labels[index] if labels else {}
        for family in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
            merged = families.setdefault(family.name, family)
            samples = [sample._replace(labels={**sample.labels, **extra}) for sample in family.samples]
            merged.samples = samples if merged is family else merged.samples + samples
    if reporting:
        families[PREFIX + "replicas_reporting"] = GaugeMetricFamily(
            PREFIX + "replicas_reporting", "replicas whose series this answer holds", value=len(texts))
    return generate_latest(_Families(list(families.values())))


class MetricsUnavailable(Exception):
    """The replicas' series could not be gathered for this answer."""


class ServerMetrics:
    """The server's Prometheus registry: what :meth:`observe_request` and :meth:`observe_finish` count, and the
    engine's state. A replica gives ``labels`` (which replica it is: on each of its samples) and ``gather``, an async
    callable returning the :meth:`own_text` every replica (this one included) last left in one place: a replica's
    answer is built from those alone, so that whichever replica answers a scrape, each series only moves forward."""

    def __init__(self, engine, labels: dict = None, gather=None):
        self.labels, self.gather = dict(labels or {}), gather
        self._gather_failing = False
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.finished = Counter(PREFIX + "finished_requests", "generations finished, by reason", ["reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens received", registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated", registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time from submission to the first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "time between consecutive tokens",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(_EngineState(engine))

    def observe_request(self, route: str, status: int) -> None:
        """One HTTP answer on ``route``."""
        self.requests.labels(route, str(status)).inc()

    def observe_when_finished(self, handle, prompt_tokens: int) -> None:
        """Observes ``handle``'s generation (:meth:`observe_finish`) once the engine has finished it, on the running
        event loop: a request whose client went away is counted as it ended, which may be a step later, as cancelled
        or, where the step in progress ended it, as that step did, with that step's token."""
        loop = asyncio.get_running_loop()

        def finished(done) -> None:  # in the engine's thread: the work goes to the loop
            try:
                loop.call_soon_threadsafe(self.observe_finish, done, prompt_tokens)
            except RuntimeError:  # the loop has closed (the server stopped): observed here
                self.observe_finish(done, prompt_tokens)
        handle.add_done_callback(finished)

    def observe_finish(self, handle, prompt_tokens: int) -> None:
        """A finished generation (``handle.done``): its reason, tokens, time to first token and inter-token
        latencies."""
        times = handle.token_times
        self.finished.labels(handle.finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(times))
        if times:
            self.ttft.observe(times[0] - handle.submitted_at)
        for before, after in zip(times, times[1:]):
            self.itl.observe(after - before)

    def own_text(self) -> bytes:
        """This server's exposition text, its samples labelled with ``labels``."""
        text = generate_latest(self.registry)
        return merged_text([text], [self.labels]) if self.labels else text

    async def answer(self) -> bytes:
        """What ``/metrics`` answers: :meth:`own_text`, or with ``gather`` every replica's series (``replica`` labels
        tell them apart) and ``kvcache_op_replicas_reporting``. :class:`MetricsUnavailable` where they cannot be
        gathered (a partial answer would make another replica's counters seem to go back)."""
        if self.gather is None:
            return await asyncio.to_thread(self.own_text)  # the engine's metrics wait for the step in progress
        try:
            texts = list(await self.gather())
        except Exception as error:  # noqa: BLE001 - the hub restarting or stalled: this scrape fails, said once
            if not self._gather_failing:
                log.warning("the replicas' metrics could not be gathered (%s: %s); /metrics answers 503 until they "
                            "can", type(error).__name__, error)
                self._gather_failing = True
            raise MetricsUnavailable(f"the replicas' metrics could not be gathered ({type(error).__name__})") \
                from None
        if self._gather_failing:
            log.warning("the replicas' metrics are gathered again")
            self._gather_failing = False
        return merged_text(texts, reporting=True)
