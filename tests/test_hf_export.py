"""kvcache_op.hf.export_model: the graph it writes, the metadata the engine reads, the models and settings
it refuses, and a local checkpoint folder as its source."""

import itertools

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op import spec  # noqa: E402
from kvcache_op.hf import export_model, tiny_model  # noqa: E402
from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.manager import KVCacheManager  # noqa: E402
from kvcache_op.serving import Engine, ModelInfo, ModelRunner, step_feeds  # noqa: E402


def attributes(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _graph_io_is_the_decoders(model):
    inputs = [i.name for i in model.graph.input]
    assert inputs == ["input_ids", "positions", "seqstarts", "kvstarts", "cachestarts", "start_pos",
                      "decoding_batches", "max_seqlen", "max_kvlen", "cache"]
    assert "cache" not in {i.name for i in model.graph.initializer} | {o.name for o in model.graph.output}
    assert [o.name for o in model.graph.output] == ["logits"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_each_layer_is_one_fused_cache_attention_node_on_the_shared_cache(family):
    model = onnx.load(hf_models.exported(family))
    ours = [n for n in model.graph.node if n.domain == spec.DOMAIN]
    layers = hf_models.model(family).config.num_hidden_layers
    assert [n.op_type for n in ours] == ["MultiHeadCacheAttention"] * layers
    info = ModelInfo.of_model(model)
    for layer, node in enumerate(ours):
        a = attributes(node)
        assert (a["num_layer"], a["layer_idx"], a["cache_mode"], a["page_size"]) == (layers, layer, 1, 16)
        assert (a["num_heads"], a["num_kv_heads"], a["head_dim"]) == (info.num_heads, info.num_kv_heads, info.head_dim)
        assert node.input[10] == "cache" and len(node.input) == 11  # ppl.pmx's 11-input form: no scale, no mask
        assert a.get("sliding_window", 0) == info.sliding_windows[layer]  # written only when set
    _graph_io_is_the_decoders(model)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_split_pair_stays_available_one_cache_node_then_one_attention_node(family):
    model = onnx.load(hf_models.exported(family, fused_attention=False))
    ours = [n for n in model.graph.node if n.domain == spec.DOMAIN]
    layers = hf_models.model(family).config.num_hidden_layers
    assert [n.op_type for n in ours] == ["KeyValueCache", "MultiHeadAttention"] * layers
    info = ModelInfo.of_model(model)
    for layer, (kv, mha) in enumerate(zip(ours[::2], ours[1::2])):
        a = attributes(kv)
        assert (a["num_layer"], a["layer_idx"], a["cache_mode"], a["page_size"]) == (layers, layer, 1, 16)
        assert kv.input[8] == "cache" and list(mha.input[1:3]) == list(kv.output)
        assert attributes(mha).get("sliding_window", 0) == info.sliding_windows[layer]
    _graph_io_is_the_decoders(model)


@pytest.mark.parametrize("settings", [dict(fused_attention=False), dict(cache_layout=3)])
def test_both_graph_forms_serve_the_models_own_greedy_tokens(settings):
    """The split pair, and the fused node on a head-major cache, both serve the tokens of transformers' own
    greedy generation (the default export, fused on layout 1, is held to it by the engine's tests; quantized
    caches by test_serving_engine's)."""
    path = hf_models.exported("llama", **settings)
    prompts = [[5, 6, 7, 8, 9] * 7, [300, 2, 3], list(range(40, 90))]
    tokens = Engine(path, num_pages=16).generate(prompts, 10)
    model = hf_models.model("llama")
    assert tokens == [reference_generate(model, p, 10) for p in prompts]


def test_metadata_describes_the_model_and_the_cache():
    info = ModelInfo.of_model(hf_models.exported("mistral", quant_bit=8, cache_layout=1))
    config = hf_models.model("mistral").config
    assert (info.family, info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, info.vocab_size) == (
        "mistral", config.num_hidden_layers, 4, 2, 16, config.vocab_size)
    assert info.sliding_windows == (24,) * 3 and info.uniform_window == 24
    assert (info.quant_bit, info.cache_layout, info.cache_dtype, info.scale_dtype) == (8, 1, "float32", "float32")
    inv_freq = hf_models.model("mistral").model.rotary_emb.inv_freq
    assert np.array_equal(np.float32(info.inv_freq), inv_freq.numpy())


def test_the_torchscript_exporter_serves_the_same_tokens():
    path = hf_models.exported("qwen2", dynamo=False)
    prompts = [[5, 6, 7, 8, 9] * 7, [300, 0, 3], list(range(40, 90)), [0] * 20]  # 0: transformers' pad id here
    tokens = Engine(path, num_pages=16).generate(prompts, 12)
    model = hf_models.model("qwen2")
    assert tokens == [reference_generate(model, p, 12) for p in prompts]


def test_a_local_bfloat16_checkpoint_folder_exports_in_float32(tmp_path):
    """Checkpoints usually ship bfloat16 weights; the folder is loaded in float32 (ONNX Runtime's CPU EP
    has no bfloat16 kernels for the rest of the graph), and a bfloat16 model object is refused clearly."""
    import torch
    from transformers import AutoModelForCausalLM

    tiny_model("llama", seed=3).to(torch.bfloat16).save_pretrained(tmp_path / "checkpoint")
    path = export_model(str(tmp_path / "checkpoint"), tmp_path / "from-folder.onnx")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32)
    prompts = [list(range(1, 30)), [7] * 20]
    assert Engine(path, num_pages=8).generate(prompts, 8) == [reference_generate(model, p, 8) for p in prompts]
    with pytest.raises(ValueError, match="the model computes in bfloat16"):
        export_model(model.to(torch.bfloat16), tmp_path / "bf16.onnx")


def test_a_float16_model_exports_and_serves_its_own_greedy_tokens(tmp_path):
    """The routing check runs a float16 model widened to float32 (float16 rounding alone moved its logits by 0.024,
    past the check's float32 bound) and leaves every parameter and buffer as it was; the export computes in float16,
    and the engine's greedy tokens agree with the model's own float16 generation."""
    import copy

    import torch

    from kvcache_op.benchmarks.serving.peers import agreement

    model = copy.deepcopy(hf_models.model("llama")).half()
    before = {name: t.clone() for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    path = export_model(model, tmp_path / "llama-float16.onnx")
    after = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    assert all(after[n].dtype == t.dtype and torch.equal(after[n], t) for n, t in before.items())
    assert ModelInfo.of_model(path).cache_dtype == "float16"
    prompts = [[5, 6, 7, 8, 9] * 7, [300, 2, 3], list(range(40, 90))]
    tokens = Engine(path, num_pages=16).generate(prompts, 10)
    reference = [reference_generate(model, p, 10) for p in prompts]
    assert agreement(tokens, reference) >= 0.9, (tokens, reference)  # all 30 agree on the machines tried


def test_unsupported_settings_and_length_dependent_rotary_are_refused_clearly(tmp_path):
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"rope type 'dynamic' \(model.rotary_emb\) changes its frequencies"):
        export_model(dynamic, tmp_path / "x.onnx")
    # A rotary module keeping a type per layer type (Gemma 3's): its full-attention layers' longrope switches to its
    # long factors past 100 positions, which the 64-token routing check does not reach (it exported, served wrong)
    half = 8  # head_dim 16: 8 frequencies
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 100,
                "factor": 4.0, "short_factor": [1.0] * half, "long_factor": [1.0 + 3.0 * i for i in range(half)]}
    per_layer_type = tiny_model("gemma3_text", head_dim=16, max_position_embeddings=400, rope_parameters={
        "full_attention": longrope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    with pytest.raises(ValueError, match=r"rope type 'longrope' \(model.rotary_emb, full_attention layers\) "):
        export_model(per_layer_type, tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="the model has 12 positions"):  # the probes' position, not "ALiBi"
        export_model(tiny_model("llama", max_position_embeddings=12), tmp_path / "x.onnx")
    model = hf_models.model("llama")
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, bfloat16, got 'int8'"):
        export_model(model, tmp_path / "x.onnx", dtype="int8")
    with pytest.raises(ValueError, match="quant_bit must be 0, 4 or 8"):
        export_model(model, tmp_path / "x.onnx", quant_bit=2)
    for page_size in (0, 4097):  # the tracing step's cache holds seven pages: larger ones are refused
        with pytest.raises(ValueError, match=f"page_size must be 1 to 4096, got {page_size}"):
            export_model(model, tmp_path / "x.onnx", page_size=page_size)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        export_model(str(tmp_path / "missing"), tmp_path / "x.onnx")
    # settings that are not what they would be coerced into: page_size 2.7 exported as 2, "false" as fused
    for name, value in (("page_size", 2.7), ("quant_bit", True), ("cache_layout", "1"), ("quant_group", 8.0)):
        with pytest.raises(ValueError, match=f"{name} must be an integer, got {value!r}"):
            export_model(model, tmp_path / "x.onnx", **{name: value})
    with pytest.raises(ValueError, match="fused_attention must be True or False, got 'false'"):
        export_model(model, tmp_path / "x.onnx", fused_attention="false")
    assert not (tmp_path / "x.onnx").exists()


def test_a_path_that_cannot_be_written_is_refused_before_the_export(tmp_path, monkeypatch):
    """Found before minutes of probing and tracing, not after them (and named as given, not as its temporary file)."""
    from kvcache_op.hf import decoder

    def no_work(*args, **kwargs):
        raise AssertionError("the export began")

    monkeypatch.setattr(decoder.PackedDecoder, "__init__", no_work)
    model = hf_models.model("llama")
    with pytest.raises(FileNotFoundError, match=f"the folder of {tmp_path / 'no' / 'x.onnx'} does not exist"):
        export_model(model, tmp_path / "no" / "x.onnx")
    (tmp_path / "folder.onnx").mkdir()
    with pytest.raises(ValueError, match="folder.onnx is a folder: name the ONNX file to write"):
        export_model(model, tmp_path / "folder.onnx")


def test_the_engine_refuses_a_model_without_metadata_and_a_request_too_big(tmp_path):
    plain = onnx.load(hf_models.exported("llama"))
    del plain.metadata_props[:]
    onnx.save(plain, tmp_path / "plain.onnx")
    with pytest.raises(ValueError, match="carries no kvcache_op metadata: export it with kvcache_op.hf.export_model"):
        Engine(tmp_path / "plain.onnx", num_pages=4)
    engine = Engine(hf_models.exported("llama"), num_pages=2)
    with pytest.raises(ValueError, match=r"prompt 0: 40 tokens \+ max_new_tokens=4 need 3 pages of 16, more than "
                                         r"num_pages=2: give the engine more pages"):
        engine.generate([list(range(40))], 4)
    assert not engine.manager.requests


def test_step_feeds_are_the_plan_with_decodes_counted():
    manager = KVCacheManager(16, 4, 8)
    manager.add_request("a", [1, 2, 3])
    manager.add_request("b", [4, 5, 6, 7, 8])
    manager.commit(manager.schedule({"a": [1, 2, 3]}))
    plan = manager.schedule({"a": [9], "b": [4, 5, 6]})
    feeds = step_feeds(plan)
    assert feeds["input_ids"].tolist() == [9, 4, 5, 6] and int(feeds["decoding_batches"]) == 1
    assert feeds["positions"].tolist() == [3, 0, 1, 2]
    for name, array in plan.op_inputs().items():
        if name == "cachestarts":  # cut to the columns the step uses
            assert (array[:, 1:] == -1).all() and feeds[name].shape == (2, 1)
            array = array[:, :1]
        assert np.array_equal(feeds[name], array) and feeds[name].dtype == np.int64
    manager.abort(plan)
    plan = manager.schedule({"b": [4, 5], "a": [9]})
    assert int(step_feeds(plan)["decoding_batches"]) == 0, "a decode after a prefill is not counted"


def test_one_prefill_step_gives_the_models_logits():
    runner = ModelRunner(hf_models.exported("llama"), num_pages=4)
    manager = KVCacheManager(4, 16, 4)
    prompt = list(range(3, 40))
    manager.add_request(0, prompt)
    logits = runner.run(step_feeds(manager.schedule({0: prompt})))
    import torch

    with torch.no_grad():
        want = hf_models.model("llama")(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0], want, atol=1e-4, rtol=1e-4)


def test_layers_of_different_softmax_scales_are_refused_for_what_the_export_records(tmp_path):
    """GPT-2 scaling each layer's scores by 1/(layer+1) (scale_attn_by_inverse_layer_idx): the metadata holds one
    softmax scale, and the refusal says so (it said the cache needed one shape)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128,
                                  scale_attn_by_inverse_layer_idx=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with pytest.raises(ValueError, match=r"layers differ in softmax scale \(\[0\.125, 0\.25\]\): the exported model "
                                         r"records one softmax scale for all its layers"):
        export_model(model, tmp_path / "x.onnx")


def test_the_callers_model_keeps_its_training_mode(tmp_path):
    """The export runs the model in eval mode; each module comes back as it was, a fine-tuning setup's frozen parts
    in eval included."""
    model = tiny_model("llama", seed=3).train()
    model.model.layers[1].eval()
    before = {name: m.training for name, m in model.named_modules()}
    assert not all(before.values())
    export_model(model, tmp_path / "x.onnx")
    assert {name: m.training for name, m in model.named_modules()} == before
