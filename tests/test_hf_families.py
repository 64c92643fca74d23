"""Any transformers decoder exports through its own forward: for every family below (tiny random-weight
configs), the engine serving the exported graph gives transformers' own greedy tokens, for prompts that share a
prefix, prompts longer than any sliding window and short ones. What the graph cannot express is refused from the
model's structure, never by family name."""

import os

import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.hf import export_model, tiny_model  # noqa: E402
from kvcache_op.hf.tiny import FAMILY_DEFAULTS  # noqa: E402
from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.serving import Engine, ModelInfo  # noqa: E402

SHARED = list(range(5, 37))  # two full pages of 16 shared by the first two prompts
PROMPTS = [SHARED + list(range(40, 50)), SHARED + [7, 8, 9], list(range(100, 140)), [200, 201, 202]]
# Families whose keys are not moved by one set of rotary frequencies (per-layer-type rotary): no StreamingLLM shift.
NO_SHIFT = {"gemma3_text"}


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_the_served_export_gives_the_models_own_greedy_tokens(family):
    model = hf_models.model(family)
    want = [reference_generate(model, p, 10) for p in PROMPTS]
    assert len({t for tokens in want for t in tokens}) >= 10, f"{family}: degenerate reference {want}"
    path = hf_models.exported(family, page_size=8)
    engine = Engine(path, num_pages=64)
    assert engine.generate(PROMPTS, 10) == want
    assert engine.metrics()["prefix_hit_tokens"] > 0
    info = ModelInfo.of_model(path)
    window = model.config.sliding_window if getattr(model.config, "sliding_window", None) else 0
    assert max(info.sliding_windows) == window  # the window every sliding layer passed to the interface
    assert bool(info.inv_freq) == (family not in NO_SHIFT)


def test_a_model_without_one_rotary_refuses_the_key_shift_but_reevaluates():
    from kvcache_op.manager import StreamingPolicy

    path = hf_models.exported("gemma3_text", page_size=8)
    with pytest.raises(ValueError, match="StreamingLLM's key shift needs the model's rotary frequencies"):
        Engine(path, num_pages=16, streaming=StreamingPolicy(4, 4, "shift"))
    engine = Engine(path, num_pages=16, streaming=StreamingPolicy(4, 4, "reevaluate"))
    assert len(engine.generate([list(range(5, 45))], 8)[0]) == 8


def test_softcapping_reaches_the_attention_nodes():
    model = hf_models.model("gemma2")
    nodes = [n for n in onnx.load(hf_models.exported("gemma2", page_size=8), load_external_data=False).graph.node
             if n.op_type == "MultiHeadCacheAttention"]
    softcaps = {a.f for n in nodes for a in n.attribute if a.name == "softcap"}
    windows = [next((a.i for a in n.attribute if a.name == "sliding_window"), 0) for n in nodes]  # 0: omitted
    assert softcaps == {model.config.attn_logit_softcapping}
    assert windows == [24 if t == "sliding_attention" else 0 for t in model.config.layer_types]


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral"])
def test_an_int8_cache_agrees_with_the_model_on_the_same_quantized_cache(family):
    from kvcache_op.hf.verify import stored_kv

    model = hf_models.model(family)
    path = hf_models.exported(family, page_size=8, quant_bit=8)
    rounding = stored_kv(ModelInfo.of_model(path))
    got = Engine(path, num_pages=64).generate(PROMPTS, 8)
    want = [reference_generate(model, p, 8, rounding) for p in PROMPTS]
    agreement = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(map(len, want))
    assert agreement >= 0.9, (agreement, got, want)


def _tiny(family, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**base, **config}),
                                            attn_implementation="eager", dtype=torch.float32).eval()


class _OwnAttention(torch.nn.Module):
    """An attention that does not go through transformers' attention interface."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, *args, **kwargs):
        return self.inner.o_proj(self.inner.v_proj(hidden_states).repeat(1, 1, 2)), None


@pytest.mark.parametrize("make, message", [
    (lambda: _tiny("deepseek_v3", kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                   v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
     "multi-head latent attention"),
    (lambda: _tiny("qwen3_next", head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
                   linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32),
     "layer types linear_attention: only full and sliding-window softmax attention"),
    (lambda: _tiny("falcon", alibi=True), "fails with its attention routed to the ops"),
    (lambda: _tiny("bloom", n_layer=2, n_head=4), r"layers \[0, 1\] of 2 do not attend through"),
    (lambda: tiny_model("llama", sliding_window=24, layer_types=["sliding_attention"] * 3),
     "layer 0 has a sliding window in its config that its attention does not pass"),
    # A window the layers pass to the attention but the model's own mask never applies (OLMoE builds a plain causal
    # mask whatever its config says): exported, the ops would apply it and serve other tokens past the window.
    (lambda: _tiny("olmoe", num_experts=4, num_experts_per_tok=2, sliding_window=100),
     "pass a sliding window of 100 to the attention interface, but over 102 tokens its routed forward differs"),
    # the same where the model holds 101 positions: the window acts at the last one
    (lambda: _tiny("olmoe", num_experts=4, num_experts_per_tok=2, sliding_window=100, max_position_embeddings=101),
     "pass a sliding window of 100 to the attention interface, but over 101 tokens"),
    # Attention sinks passed to the interface: named, not only found by the routed logits differing
    (lambda: _tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                   layer_types=["full_attention"] * 2),
     r"layer 0 \(GptOssAttention\) passes attention sinks \(s_aux\) to its attention"),
    # Two attentions a layer (differential attention): their values would share one cache layer.
    (lambda: _tiny("diffllama"), r"layer 0 \(DiffLlamaAttention\) calls attention more than once in a forward"),
    # Llama 4's attention temperature takes positions from arange(T) plus the cache's length, not position_ids:
    # right for one sequence prefilled from 0 (what the check once ran), wrong in a packed step or a continuation.
    (lambda: _tiny("llama4_text", head_dim=16, num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=128,
                   interleave_moe_layer_step=1, layer_types=["full_attention"] * 2, no_rope_layers=[0, 0],
                   attention_chunk_size=None, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
                   use_qk_norm=False),
     "a packed prefill of 36 and 21 tokens followed by a step continuing both"),
])
def test_what_the_graph_cannot_express_is_refused_by_structure(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        export_model(make(), tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def test_a_layer_with_its_own_attention_is_refused(tmp_path):
    model = tiny_model("llama", seed=5)
    model.model.layers[1].self_attn = _OwnAttention(model.model.layers[1].self_attn)
    with pytest.raises(ValueError, match=r"layers \[1\] of 3 do not attend through transformers' attention interface"):
        export_model(model, tmp_path / "x.onnx")


def test_a_model_whose_attention_differs_after_the_interface_is_refused(tmp_path, monkeypatch):
    """The last line of defence: a forward that runs routed but gives other logits (here: attention output
    scaled after the interface, which a structural check cannot see) is refused."""
    model = tiny_model("llama", seed=6)
    attention = model.model.layers[0].self_attn
    original = attention.o_proj.forward
    monkeypatch.setattr(attention.o_proj, "forward",
                        lambda x: original(x * (1.5 if model.config._attn_implementation != "eager" else 1.0)))
    with pytest.raises(ValueError, match="differs from its own by"):
        export_model(model, tmp_path / "x.onnx")


def test_a_float16_model_keeps_its_key_shift():
    """A float16 model's keys are probed widened to float32: in float16 they missed the rotation check's tolerance,
    and the export recorded no frequencies (StreamingLLM's shift refused). Its frequencies are its own float16 ones,
    and its parameters come back float16."""
    from kvcache_op.hf.structure import decoder_sizes

    model = tiny_model("llama").half()
    sizes = decoder_sizes(model)
    assert sizes.inv_freq == tuple(float(f) for f in model.model.rotary_emb.inv_freq.float())
    assert len(sizes.inv_freq) == 8 and {p.dtype for p in model.parameters()} == {torch.float16}


def test_stop_ids_past_the_vocabulary_are_left_out():
    """A config's default end-of-sequence ids kept over a smaller vocabulary can never be generated: the export
    leaves them out (the engine refuses metadata naming them, so such a file could not be served)."""
    from kvcache_op.hf.structure import eos_token_ids

    model = _tiny("llama", eos_token_id=[2, 5000, 127, 128])
    assert eos_token_ids(model) == (2, 127)


def test_an_op_the_onnx_exporter_cannot_convert_is_a_clear_error(tmp_path, monkeypatch):
    """torch's exporter failing on an op it has no ONNX function for (Gemma 3n's activation sparsity computes
    erfinv) is a ValueError naming the op, not the exporter's traceback."""
    from kvcache_op import torch as kt

    def unconvertible(*args, **kwargs):
        raise RuntimeError("ConversionError: No ONNX function found for prims.erf_inv.default. Failure ...")
    monkeypatch.setattr(kt.export, "checked_export", unconvertible)
    with pytest.raises(ValueError, match=r"computes prims\.erf_inv\.default, which torch's ONNX exporter has no "
                                         r"function for"):
        export_model(tiny_model("llama", seed=1), tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def serve_in_float16(family: str, folder: str) -> None:
    """Exports the family's tiny model in float16 into ``folder`` and serves 4 greedy tokens (run in a subprocess)."""
    path = export_model(tiny_model(family).half(), os.path.join(folder, "x.onnx"), page_size=8)
    tokens = Engine(path, num_pages=32, intra_op_num_threads=1).generate([[1, 2, 3, 4, 5]], 4)
    assert len(tokens[0]) == 4


@pytest.mark.parametrize("family", ["gemma", "gpt_neox"])
def test_a_float16_model_exports_a_file_onnx_runtime_serves(family, tmp_path):
    """Gemma's norms compute in float32 over a float16 residual: fused with the residual add they made a
    SkipSimplifiedLayerNormalization of two types, which ONNX Runtime refused at load. An exported GPT-NeoX in float16
    crashed ONNX Runtime's NCHWc layout transformer while loading (in a subprocess here: a crash fails the test)."""
    from isolated import assert_passes_isolated

    assert_passes_isolated("test_hf_families", f"serve_in_float16({family!r}, {str(tmp_path)!r})")


def test_the_demo_offers_every_tested_family():
    from kvcache_op.cli import DEMO_FAMILIES

    assert DEMO_FAMILIES == tuple(sorted(FAMILY_DEFAULTS))


def test_a_window_the_model_applies_passes_the_longer_check(tmp_path):
    """The other side of OLMoE's refusal: Mistral's mask applies the window it passes, so the check over window + 2
    tokens finds the routed forward equal to its own and the window is exported."""
    from kvcache_op.serving import ModelInfo

    export_model(_tiny("mistral", sliding_window=100), tmp_path / "x.onnx")
    assert ModelInfo.of_model(tmp_path / "x.onnx").sliding_windows == (100, 100)
