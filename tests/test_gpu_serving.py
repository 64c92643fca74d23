"""The exported decoder on ONNX Runtime's CUDA EP: every op of the graph placed on the GPU (no CPU fallback), the
graph's greedy tokens too, the cache allocated once on the device and written in place, and the engine's greedy
tokens (chosen on the device: no row of logits crosses to the host) equal transformers' own greedy generation on the
same GPU, for the fused node and the split pair. Sampled tokens are drawn on the device too (the sampling graph,
every node on the GPU), as the host sampler draws them; the engine's default providers serve StreamingLLM's key
shift and the sampling graph. Skipped centrally without a GPU and onnxruntime-gpu."""

import copy

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.ort_ops import make_session  # noqa: E402
from kvcache_op.serving import Engine  # noqa: E402
from kvcache_op.serving.next_decode_graph import with_greedy_tokens  # noqa: E402

pytestmark = pytest.mark.ort_gpu

PROMPTS = [[5, 6, 7, 8, 9] * 7, [300, 2, 3], list(range(40, 90))]


@pytest.mark.parametrize("settings", [dict(), dict(fused_attention=False)], ids=["fused", "split"])
def test_no_node_of_the_exported_decoder_falls_back_to_the_cpu(settings):
    """session.disable_cpu_ep_fallback: ONNX Runtime refuses the session if any node would run on the CPU EP; the
    graph as the engine serves it on a device (its greedy tokens added) too."""
    import onnx

    path = hf_models.exported("llama", **settings)
    make_session(path, providers=("CUDAExecutionProvider",), disable_cpu_fallback=True)
    make_session(with_greedy_tokens(onnx.load(path)), providers=("CUDAExecutionProvider",), disable_cpu_fallback=True)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_gpus_greedy_tokens_are_numpys_argmax_of_the_logits(dtype):
    """The device's ArgMax chooses as numpy's: the first of equal maxima (rows of small integers have many), of +0 and
    -0 the first; a row of -inf gives 0 (the graph clips the logits first: the CUDA ArgMax gives INT32_MAX for -inf)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    element = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    one = numpy_helper.from_array(np.ones((), dtype), "one")  # logits = scores x 1, exactly, on the device
    graph = helper.make_graph([helper.make_node("Mul", ["scores", "one"], ["logits"])], "logits",
                              [helper.make_tensor_value_info("scores", element, ["n", "v"])],
                              [helper.make_tensor_value_info("logits", element, ["n", "v"])], [one])
    model = with_greedy_tokens(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10))
    session = make_session(model, providers=("CUDAExecutionProvider",), disable_cpu_fallback=True)
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.integers(-3, 3, (48, 32000)), rng.standard_normal((14, 32000)) * 8]).astype(dtype)
    scores = np.concatenate([scores, np.full((2, 32000), -np.inf, dtype)])
    scores[48, :] = -1.0
    scores[48, [9, 20]] = [-0.0, 0.0]  # equal: the first
    tokens = session.run(["next_input_ids"], {"scores": scores})[0]
    expected = np.argmax(scores, axis=1)
    assert np.array_equal(tokens[:-2], expected[:-2]) and expected[48] == 9
    assert tokens[-2:].tolist() == [0, 0]  # the graph reads the logits clipped: no INT32_MAX for a row of -inf


@pytest.mark.parametrize("settings", [dict(), dict(fused_attention=False)], ids=["fused", "split"])
def test_the_engine_on_the_cuda_ep_serves_the_models_own_greedy_tokens(settings):
    path = hf_models.exported("llama", **settings)
    engine = Engine(path, num_pages=16, providers=["CUDAExecutionProvider"])
    assert engine.runner.device == ("cuda", 0)
    # a GPU's default budget (8192), within the 1024 positions of the model's rotary tables: every prompt in one step
    assert engine.runner.step_token_limit == 1024 and engine.max_batch_tokens == 1024
    tokens = engine.generate(PROMPTS, 10)
    assert engine.runner.device_logit_rows == 0  # chosen on the device
    model = copy.deepcopy(hf_models.model("llama")).to("cuda")  # the same GPU, float32 (the cached model stays put)
    assert tokens == [reference_generate(model, p, 10) for p in PROMPTS]


def test_prompts_longer_than_a_step_are_chunked_at_the_gpu_budget():
    """Three prompts of 500 tokens, 1,500 together: more than a GPU step takes here (8192 lowered to the model's 1,024
    positions), so the prompts are fed in 1,024-token steps, one prompt split across two, and the tokens are still
    the model's own on the same GPU."""
    import numpy as np

    prompts = np.random.default_rng(7).integers(1, 384, (3, 500)).tolist()
    engine = Engine(hf_models.exported("llama"), num_pages=112, providers=["CUDAExecutionProvider"])
    tokens = engine.generate(prompts, 8)
    assert engine.metrics()["steps"] >= 2 + 7  # at least two steps to feed the prompts, then seven decode steps
    model = copy.deepcopy(hf_models.model("llama")).to("cuda")
    assert tokens == [reference_generate(model, p, 8) for p in prompts]


def test_float16_agreement_with_transformers_on_the_same_gpu(tmp_path, record_property):
    """A float16 export on the CUDA EP against the float16 model's own greedy generation on the same GPU: the share of
    positions where both chose the same token (recorded in the junit report as float16_agreement)."""
    from kvcache_op.benchmarks.serving.peers import agreement
    from kvcache_op.hf import export_model

    model = copy.deepcopy(hf_models.model("llama")).half()
    path = export_model(model, tmp_path / "llama-float16.onnx")
    tokens = Engine(path, num_pages=16, providers=["CUDAExecutionProvider"]).generate(PROMPTS, 10)
    model = model.to("cuda")
    rate = agreement(tokens, [reference_generate(model, p, 10) for p in PROMPTS])
    record_property("float16_agreement", rate)
    assert rate >= 0.5, rate  # float16 sums in another order may part ways after a near-tie, not at random


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_gpus_sampling_graph_draws_the_host_samplers_tokens(dtype):
    """The sampling graph with every node on the GPU, over a real vocabulary's width: ONNX Runtime's CUDA TopK gives
    tied values out of index order (the graph reads its values alone), and its CumSum adds each element's
    predecessors one by one (the graph adds in chunks)."""
    import numpy as np

    from kvcache_op.reference.dtypes import BFLOAT16
    from sampler_graph_checks import check_against_host

    from sampler_graph_checks import run_graph
    from sampling_batches import host_tokens
    from kvcache_op.serving import SamplingParams

    element = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    check_against_host(np.random.default_rng(23), 32000, rounds=12, dtype=element, provider="CUDAExecutionProvider")
    # rows of -inf: the graph's ArgMax reads the logits clipped to +-FINITE (ONNX Runtime's CUDA ArgMax gives
    # INT32_MAX for a row of -inf), and a sampled one draws from the clipped row's uniform distribution, as the host
    logits = np.full((2, 32000), -np.inf, np.float32).astype(element)
    params = [SamplingParams(), SamplingParams(temperature=0.7)]
    tokens, _, complete = run_graph(logits, params, [0.0, 0.30001], "CUDAExecutionProvider")
    assert complete.all() and tokens.tolist() == host_tokens(logits, params, [0.0, 0.30001]) and tokens[0] == 0


def test_the_engines_sampled_tokens_are_drawn_on_the_gpu_as_on_the_host():
    """Seeded sampled requests on the CUDA EP under the default providers (the CUDA EP and the CPU EP named): drawn on
    the device with no row of logits copied, the same tokens as the host sampler draws from the same GPU's logits."""
    from kvcache_op.serving import SamplingParams

    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=1), SamplingParams(temperature=1.2, top_k=8, seed=2),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3)]
    path = hf_models.exported("llama")
    on_device = Engine(path, num_pages=16)
    assert on_device.runner.providers[-1] == "CPUExecutionProvider" and on_device.runner.graph_sampling
    tokens = on_device.generate(PROMPTS, 12, params=params)
    assert on_device.runner.device_logit_rows == 0
    on_host = Engine(path, num_pages=16)
    on_host.runner.graph_sampling = False
    assert on_host.generate(PROMPTS, 12, params=params) == tokens
    assert on_host.runner.device_logit_rows > 0


def test_streaming_llm_shifts_keys_on_the_gpu_under_the_default_providers():
    """The key shift's session keeps every node on the device: with the CPU EP named (the default providers) ONNX
    Runtime would refuse it unless the runner leaves the CPU EP out. The tokens are those of the CUDA EP alone."""
    from kvcache_op.manager import StreamingPolicy

    path = hf_models.exported("llama")
    policy = StreamingPolicy(sinks=4, budget_pages=4, mode="shift")
    prompts = [list(range(40, 110)), list(range(5, 75))]
    default = Engine(path, num_pages=16, streaming=policy)
    shifts, shift_keys = [], default.runner.shift_keys
    default.runner.shift_keys = lambda slots, deltas: (shifts.append(len(slots)), shift_keys(slots, deltas))
    tokens = default.generate(prompts, 12)
    assert sum(shifts) > 0  # 70-token prompts over a 64-token budget
    alone = Engine(path, num_pages=16, streaming=policy, providers=["CUDAExecutionProvider"])
    assert alone.generate(prompts, 12) == tokens
