"""``run_model``'s kept sessions under callers in several threads: two callers making sessions at once (held
together while they make them) keep the cache within its size, and each gets its own model's answer. A model given as
bytes, a bytearray or a path runs too, and a path rewritten between calls runs as it is now."""

import threading

import onnx

from ort_helpers import assert_same_bits, copies, reference_result

from kvcache_op import spec
from kvcache_op.ort_ops import run_model, session as ort_session
from kvcache_op.validation.cases import CASES


def test_two_callers_making_sessions_at_once_keep_the_cache_within_its_size(monkeypatch):
    names = list(CASES)[:ort_session._MAX_CACHED_SESSIONS + 2]
    cases = [CASES[name]() for name in names]
    models = [spec.make_model(copies(c.inputs), **c.attributes) for c in cases]
    monkeypatch.setattr(ort_session, "_SESSIONS", ort_session.KeptSessions(ort_session._MAX_CACHED_SESSIONS))
    for case, model in zip(cases[:-2], models[:-2]):  # a full cache
        run_model(model, {k: v for k, v in copies(case.inputs).items() if v is not None}, intra_op_num_threads=1)
    assert len(ort_session._SESSIONS) == ort_session._MAX_CACHED_SESSIONS
    together = threading.Barrier(2, timeout=10)
    make = ort_session.make_session

    def held_make(*args, **kwargs):  # both callers are making a session at the same time
        together.wait()
        return make(*args, **kwargs)

    monkeypatch.setattr(ort_session, "make_session", held_make)
    results, errors = {}, []

    def call(i):
        try:
            fresh = copies(cases[i].inputs)
            key, value = run_model(models[i], {k: v for k, v in fresh.items() if v is not None},
                                   intra_op_num_threads=1)
            results[i] = (key, value, fresh["cache"], fresh["scale"])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in (len(cases) - 2, len(cases) - 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(ort_session._SESSIONS) <= ort_session._MAX_CACHED_SESSIONS
    for i, got in results.items():
        assert_same_bits(got, reference_result(cases[i].inputs, cases[i].attributes))
    assert len(results) == 2


def test_a_model_given_as_bytes_or_a_path_runs_and_a_rewritten_path_is_not_served_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(ort_session, "_SESSIONS", ort_session.KeptSessions(ort_session._MAX_CACHED_SESSIONS))
    case = CASES["layers2_layer_idx1_layout0"]()
    path = tmp_path / "model.onnx"
    for layer_idx in (1, 0):  # the same file rewritten: the second call must store into layer 0
        attributes = dict(case.attributes, layer_idx=layer_idx)
        model = spec.make_model(copies(case.inputs), **attributes)
        onnx.save(model, path)
        for given in (bytearray(model.SerializeToString()), model.SerializeToString(), path, str(path)):
            fresh = copies(case.inputs)
            key, value = run_model(given, {k: v for k, v in fresh.items() if v is not None})
            assert_same_bits((key, value, fresh["cache"], fresh["scale"]), reference_result(case.inputs, attributes))
    assert len(ort_session._SESSIONS) == 2  # the two models' bytes (a bytearray is kept as bytes); no path is kept
