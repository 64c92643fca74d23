"""``/metrics`` of replicas behind one address (``kvcache_op.serving.server.metrics``): one answer holds every
replica's series, each labelled with its replica, every family once, all of them as the replicas last left them in
one place (so a series never goes back from one scrape to the next, whichever replica answers); where they cannot
be gathered the scrape fails (503), and the log says so once. (``test_server_ray.py`` runs it on Ray Serve.)"""

import asyncio
import logging

import pytest

pytest.importorskip("prometheus_client", reason="the server needs the 'serve' extra: pip install '.[serve]'")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvcache_op.serving.server.metrics import MetricsUnavailable, ServerMetrics, merged_text  # noqa: E402


class StubEngine:
    """What the metrics read of an engine."""

    def __init__(self, pages_in_use):
        self.pages_in_use, self.queue_length, self.running_count = pages_in_use, 0, 1

    def metrics(self):
        return dict(pages_in_use=self.pages_in_use, pages_total=64, pages_cached=0, prefix_hit_rate=0.0,
                    prefix_hit_tokens=0, fed_tokens=5, steps=2, preemptions=0)


def _families(text):
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def _values(families, family, sample, **labels):
    return {s.labels.get("replica"): s.value for s in families[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())}


def _replicas():
    """Two replicas' metrics, each gathering what both left at a shared hub (a list here)."""
    hub = {}

    async def gather():
        return list(hub.values())
    a = ServerMetrics(StubEngine(3), labels={"replica": "a"}, gather=gather)
    b = ServerMetrics(StubEngine(7), labels={"replica": "b"}, gather=gather)
    for metrics, count in ((a, 2), (b, 1)):
        for _ in range(count):
            metrics.observe_request("/v1/completions", 200)
    a.observe_request("/health", 200)
    hub.update(a=a.own_text(), b=b.own_text())
    return a, b


def test_one_answer_holds_every_replicas_series_labelled():
    a, b = _replicas()
    text = asyncio.run(b.answer())
    families = _families(text)
    assert _values(families, "kvcache_op_requests", "kvcache_op_requests_total", route="/v1/completions") == \
        {"a": 2.0, "b": 1.0}
    assert _values(families, "kvcache_op_requests", "kvcache_op_requests_total", route="/health") == {"a": 1.0}
    assert _values(families, "kvcache_op_pages_in_use", "kvcache_op_pages_in_use") == {"a": 3.0, "b": 7.0}
    buckets = [s for s in families["kvcache_op_time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["replica"] for s in buckets} == {"a", "b"}
    assert [s.value for s in families["kvcache_op_replicas_reporting"].samples] == [2.0]
    types = [line for line in text.decode().splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family appears twice"
    assert asyncio.run(a.answer()) == text  # either replica answers the same


def test_a_replica_answers_its_own_series_as_it_left_them_too():
    """Counted since the last time it left its series, a replica's own count is not in its answer yet: answered
    live, it would exceed what another replica answers from the hub, and the series would seem to go back."""
    a, b = _replicas()
    b.observe_request("/v1/completions", 200)
    families = _families(asyncio.run(b.answer()))
    assert _values(families, "kvcache_op_requests", "kvcache_op_requests_total", route="/v1/completions") == \
        {"a": 2.0, "b": 1.0}


def test_a_replica_that_cannot_gather_the_series_fails_the_scrape_and_says_so_once(caplog):
    async def unreachable():
        raise TimeoutError("the hub did not answer")
    metrics = ServerMetrics(StubEngine(4), labels={"replica": "c"}, gather=unreachable)
    with caplog.at_level(logging.WARNING, logger="kvcache_op.server"):
        for _ in range(3):
            with pytest.raises(MetricsUnavailable, match=r"could not be gathered \(TimeoutError\)"):
                asyncio.run(metrics.answer())
    assert caplog.text.count("could not be gathered") == 1


def test_a_single_server_answers_unlabelled():
    metrics = ServerMetrics(StubEngine(2))
    metrics.observe_request("/v1/completions", 200)
    families = _families(asyncio.run(metrics.answer()))
    assert _values(families, "kvcache_op_requests", "kvcache_op_requests_total") == {None: 1.0}
    assert "kvcache_op_replicas_reporting" not in families
    assert all("replica" not in s.labels for f in families.values() for s in f.samples)


def test_merging_keeps_every_sample_of_each_text():
    a, b = _replicas()
    texts = [a.own_text(), b.own_text()]
    merged = _families(merged_text(texts))
    separate = [_families(t) for t in texts]
    assert set(merged) == set(separate[0]) == set(separate[1])
    for name, family in merged.items():
        assert sorted(map(repr, family.samples)) == sorted(repr(s) for f in separate for s in f[name].samples), name


def test_the_apps_scrape_is_a_503_when_the_series_cannot_be_gathered(exported, served_checkpoint):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvcache_op.serving import Engine
    from kvcache_op.serving.server import create_app
    from kvcache_op.serving.tokenizer import PlainText

    async def unreachable():
        raise TimeoutError("the hub did not answer")
    tokenizer = served_checkpoint[2]
    engine = Engine(exported, tokenizer=PlainText(tokenizer), num_pages=64)
    app = create_app(engine, tokenizer, model_name="tiny",
                     metrics=ServerMetrics(engine, labels={"replica": "x"}, gather=unreachable))
    with TestClient(app) as client:
        reply = client.get("/metrics")
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["message"] == "the replicas' metrics could not be gathered (TimeoutError)"
        assert client.get("/health").status_code == 200
