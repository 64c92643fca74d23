"""What ``deployment()`` refuses before Ray Serve starts a replica: engine options an Engine cannot take (Ray Serve
would say only "Deploying application failed", after every replica tried), and a drain file that already exists
(every replica would close its engine as it started and still answer /health)."""

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve deployment needs the 'ray' extra: pip install '.[ray]'")
pytest.importorskip("fastapi")

from kvcache_op.serving.ray import deployment, drained_replicas  # noqa: E402


@pytest.mark.parametrize("options, message", [
    ({}, "missing a required argument: 'num_pages'"),
    ({"num_pages": 8, "num_page": 9}, "unexpected keyword argument 'num_page'"),
    ({"num_pages": 8, "tokenizer": None}, "multiple values for keyword argument 'tokenizer'"),
])
def test_engine_options_an_engine_cannot_take_are_refused_by_name(tmp_path, options, message):
    with pytest.raises(TypeError, match=message):
        deployment(tmp_path / "model.onnx", tmp_path, replicas=1, model_name="m", **options)


@pytest.mark.parametrize("left", ["drain", "drain.1234"])
def test_a_drain_file_or_a_replicas_mark_already_there_is_refused(tmp_path, left):
    (tmp_path / left).touch()
    with pytest.raises(ValueError, match=f"{left} already exist"):
        deployment(tmp_path / "model.onnx", tmp_path, replicas=1, model_name="m", num_pages=8,
                   drain_file=tmp_path / "drain")


def test_drained_replicas_counts_the_marks_of_replicas_only(tmp_path):
    for name in ("drain.10", "drain.11", "drain.log", "drain.10.tmp", "drainage.12"):
        (tmp_path / name).touch()
    assert drained_replicas(tmp_path / "drain") == 2


def test_a_fresh_drain_file_path_is_taken_and_left_to_be_made(tmp_path):
    from ray.serve import Application

    app = deployment(tmp_path / "model.onnx", tmp_path, replicas=1, model_name="m", num_pages=8,
                     drain_file=tmp_path / "drain")
    assert isinstance(app, Application) and not list(tmp_path.iterdir())
