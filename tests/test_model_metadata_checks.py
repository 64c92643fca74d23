"""The engine does not trust an exported decoder's metadata blindly: a value of the wrong type or range, or one
its graph contradicts, is refused by name before anything runs."""

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op import spec  # noqa: E402
from kvcache_op.serving import Engine, ModelInfo  # noqa: E402


def _edited(tmp_path, settings=None, **changes):
    """The exported llama (page 16, float32, no window; ``settings``: export_model keywords) with metadata values
    replaced (raw strings)."""
    model = onnx.load(hf_models.exported("llama", **(settings or {})), load_external_data=False)
    for prop in model.metadata_props:
        key = prop.key.removeprefix("kvcache_op.")
        if key in changes:
            prop.value = changes[key]
    path = tmp_path / "edited.onnx"
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("changes, message", [
    (dict(sliding_windows="[4, 4, 4]"), "has sliding_window = 0, the metadata says 4"),
    (dict(page_size="8"), "has page_size = 16, the metadata says 8"),
    (dict(page_size="0"), "page_size = 0 (must be an integer >= 1)"),
    (dict(page_size="null"), "page_size = None (must be an integer >= 1)"),
    (dict(page_size="true"), "page_size = True (must be an integer >= 1)"),
    (dict(page_size="not json"), "'page_size' is not JSON: 'not json'"),
    (dict(quant_bit="8", scale_dtype='"float16"'), "the graph lacks the inputs"),
    (dict(quant_bit="8"), "scale_dtype = '' with quant_bit = 8"),
    (dict(num_layers="2", sliding_windows="[0, 0]"),
     "3 MultiHeadCacheAttention, 0 KeyValueCache and 0 MultiHeadAttention nodes for num_layers = 2"),
    (dict(cache_dtype='"float16"'), "the cache input is FLOAT, not FLOAT16"),
    (dict(num_kv_heads="3"), "is not a multiple of num_kv_heads = 3"),
    (dict(head_dim="8", inv_freq="[1.0, 0.5, 0.25, 0.125]"), "the cache input's axis 4 is 16, the metadata (layout 1) says 8"),
    (dict(eos_token_ids="[100000]"), "reach past vocab_size"),
    (dict(vocab_size="1000"), "the logits have 384 columns, the metadata says vocab_size = 1000"),
    (dict(softmax_scale="0.5"), "has softmax_scale = 0.25, the metadata says 0.5"),
    (dict(softmax_scale="Infinity"), "'softmax_scale' is not JSON: 'Infinity'"),
    (dict(inv_freq="[NaN, 1.0]"), "'inv_freq' is not JSON"),
    (dict(inv_freq="[" + ", ".join(["0.5"] * 9) + "]"), "a rotary dim of 18 > head_dim = 16"),
    (dict(inv_freq="[-1.0]"), "inv_freq = (-1.0,) (must be a list of finite numbers > 0)"),
])
def test_a_contradicted_or_invalid_value_is_refused_by_name(tmp_path, changes, message):
    path = _edited(tmp_path, **changes)
    with pytest.raises(ValueError) as error:
        ModelInfo.of_model(path)
    assert message in str(error.value)
    with pytest.raises(ValueError, match="re-export"):
        Engine(path, num_pages=8)


@pytest.mark.parametrize("changes, message", [
    (dict(scale_dtype='"float16"'), "the scale input is FLOAT, not FLOAT16 (scale_dtype float16)"),
    (dict(quant_group="4"), "the scale input's axis 4 is 2, the metadata (layout 1) says 4"),
])
def test_a_quantized_export_checks_its_scale(tmp_path, changes, message):
    with pytest.raises(ValueError) as error:
        ModelInfo.of_model(_edited(tmp_path, dict(quant_bit=8), **changes))
    assert message in str(error.value)


@pytest.mark.parametrize("changes, message", [
    (dict(page_size="8"), "KeyValueCache node"),
    (dict(sliding_windows="[4, 4, 4]"), "MultiHeadAttention node"),
    (dict(num_layers="2", sliding_windows="[0, 0]"),
     "0 MultiHeadCacheAttention, 3 KeyValueCache and 3 MultiHeadAttention nodes for num_layers = 2"),
])
def test_the_split_pair_export_is_checked_node_by_node(tmp_path, changes, message):
    with pytest.raises(ValueError) as error:
        ModelInfo.of_model(_edited(tmp_path, dict(fused_attention=False), **changes))
    assert message in str(error.value)


def test_an_attention_only_graph_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    feeds = dict(query=rng.standard_normal((2, 2, 8)).astype("float32"),
                 key=rng.standard_normal((2, 2, 8)).astype("float32"),
                 value=rng.standard_normal((2, 2, 8)).astype("float32"),
                 seqstarts=np.array([0, 2]), kvstarts=np.array([0, 2]),
                 decoding_batches=np.array(0), max_seqlen=np.array(2),
                 max_kvlen=np.array(2))
    model = spec.make_attention_model(feeds, num_heads=2, head_dim=8)
    exported = onnx.load(hf_models.exported("llama"), load_external_data=False)
    onnx.helper.set_model_props(model, {p.key: p.value for p in exported.metadata_props})
    path = tmp_path / "attention.onnx"
    onnx.save(model, path)
    with pytest.raises(ValueError, match=r"the graph lacks the inputs \['input_ids'"):
        ModelInfo.of_model(path)


def test_the_exported_metadata_passes_unchanged(tmp_path):
    info = ModelInfo.of_model(_edited(tmp_path))
    assert json.loads(json.dumps(info.sliding_windows)) == [0, 0, 0]
