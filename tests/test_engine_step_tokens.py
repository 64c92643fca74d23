"""A step never feeds more tokens than the exported graph's rotary tables hold: ONNX Runtime's RotaryEmbedding takes
a step's tokens as one sequence and refuses one longer than its table ("Updating cos_cache and sin_cache in
RotaryEmbedding is not currently supported"). The engine lowers its default token budget to that many tokens, and
refuses a larger one given, before anything is allocated."""

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from kvcache_op.hf import export_model, tiny_model  # noqa: E402
from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.serving import Engine, ModelRunner  # noqa: E402
from kvcache_op.serving.model_check import rotary_table_rows  # noqa: E402
from kvcache_op.ort_ops.graph_rules import load_model  # noqa: E402

POSITIONS = 64
PROMPTS = [list(range(3, 43)), list(range(50, 90)), list(range(7, 47))]  # 120 tokens together, 40 each


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A tiny Llama of 64 positions, exported (its rotary fused: tables of 64 rows), and the model."""
    model = tiny_model("llama", max_position_embeddings=POSITIONS)
    return export_model(model, tmp_path_factory.mktemp("short") / "llama64.onnx"), model


def test_the_graphs_rotary_tables_set_the_limit(short):
    path, _ = short
    assert rotary_table_rows(load_model(path)) == POSITIONS
    assert ModelRunner(path, num_pages=4).step_token_limit == POSITIONS


def test_the_default_budget_is_lowered_to_the_tables_and_serves_the_models_tokens(short):
    """With the CPU's 256 tokens a step, the three prompts' 120 tokens went to the graph in one step and ONNX Runtime
    refused it; at 64 a step they are chunked, and the tokens are the model's own."""
    path, model = short
    engine = Engine(path, num_pages=16)
    assert engine.max_batch_tokens == POSITIONS
    assert engine.generate(PROMPTS, 6) == [reference_generate(model, p, 6) for p in PROMPTS]


def test_a_larger_budget_given_is_refused_before_anything_is_allocated(short, monkeypatch):
    path, _ = short
    import kvcache_op.serving.ort_runner as ort_runner

    def no_cache(*args, **kwargs):
        raise AssertionError("the cache was allocated")

    monkeypatch.setattr(ort_runner, "_zeroed", no_cache)
    with pytest.raises(ValueError, match=r"max_batch_tokens=65 is more than the 64 positions the model's rotary "
                                         r"tables hold, .* give at most 64"):
        Engine(path, num_pages=16, max_batch_tokens=65)
    monkeypatch.undo()
    assert Engine(path, num_pages=16, max_batch_tokens=64).max_batch_tokens == 64
