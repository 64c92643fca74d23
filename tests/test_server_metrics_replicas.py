"""``/metrics`` of replicas behind one address (``kvcache_op.serving.server.metrics``): one answer holds every
replica's series, each labelled with its replica, every family once; a replica that cannot reach the others answers
its own and says how many it holds. (``test_server_ray.py`` runs it on Ray Serve.)"""

import logging

import pytest

pytest.importorskip("prometheus_client", reason="the server needs the 'serve' extra: pip install '.[serve]'")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvcache_op.serving.server.metrics import ServerMetrics, merged_text  # noqa: E402


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
    return {s.labels["replica"]: s.value for s in families[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())}


def _replicas():
    a = ServerMetrics(StubEngine(3), labels={"replica": "a"})
    b = ServerMetrics(StubEngine(7), labels={"replica": "b"}, peers=lambda: [a.own_text()])
    for metrics, count in ((a, 2), (b, 1)):
        for _ in range(count):
            metrics.observe_request("/v1/completions", 200)
    a.observe_request("/health", 200)
    return a, b


def test_one_answer_holds_every_replicas_series_labelled():
    a, b = _replicas()
    text = b.text()
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


def test_a_replica_that_cannot_reach_the_others_answers_its_own_and_says_so(caplog):
    def unreachable():
        raise TimeoutError("the hub did not answer")
    metrics = ServerMetrics(StubEngine(4), labels={"replica": "c"}, peers=unreachable)
    metrics.observe_request("/v1/completions", 200)
    with caplog.at_level(logging.WARNING, logger="kvcache_op.server"):
        families = _families(metrics.text())
    assert _values(families, "kvcache_op_requests", "kvcache_op_requests_total") == {"c": 1.0}
    assert [s.value for s in families["kvcache_op_replicas_reporting"].samples] == [1.0]
    assert "could not be read" in caplog.text


def test_a_single_server_answers_unlabelled():
    metrics = ServerMetrics(StubEngine(2))
    metrics.observe_request("/v1/completions", 200)
    families = _families(metrics.text())
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
