"""The engine serving exported decoders, checked token for token against transformers' own greedy
generation (one request at a time), with prefix hits, evictions and preemptions actually happening."""

import warnings

import numpy as np
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.hf.verify import reference_generate, reference_logits, stored_kv  # noqa: E402
from kvcache_op.serving import Engine, ModelInfo  # noqa: E402
from kvcache_op.serving.workload import shared_prefix_workload  # noqa: E402

NEW_TOKENS = 20
# 16 requests, 3 shared system prompts of 40 tokens, 3..29 user tokens, two arrivals per step; 14 pages of 16
# slots hold about 4 requests' contexts, so the engine must evict cached prefixes and preempt.
WORKLOAD = dict(count=16, vocab_size=384, seed=0)
TIGHT = dict(num_pages=14, max_batch_tokens=64, max_running=8)


def serve(path, workload, **engine_settings):
    engine = Engine(path, **{**TIGHT, **engine_settings})
    tokens = engine.generate(workload.prompts, NEW_TOKENS, salts=workload.salts,
                             arrival_steps=workload.arrival_steps, record_logits=True)
    engine.manager.check()
    assert not engine.manager.requests, "finished requests still hold pages"
    return engine, tokens


def assert_busy(metrics, preemptions=True):
    """The scenario exercised what it claims to: shared prefixes hit, cached pages were evicted, requests
    were preempted and recomputed."""
    assert metrics["prefix_hit_tokens"] > 0 and metrics["evictions"] > 0, metrics
    assert (metrics["preemptions"] > 0) == preemptions, metrics


@pytest.mark.parametrize("family, num_pages", [("llama", 14), ("mistral", 12), ("qwen2", 14)])
def test_greedy_tokens_equal_transformers_generate(family, num_pages):
    """A request of Mistral (window 24) never holds more than the window and one chunk, which admission
    counts, so its requests are never preempted; the window's releases make the evictions."""
    workload = shared_prefix_workload(**WORKLOAD)
    engine, tokens = serve(hf_models.exported(family), workload, num_pages=num_pages)
    assert_busy(engine.metrics(), preemptions=family != "mistral")
    model = hf_models.model(family)
    for i, prompt in enumerate(workload.prompts):
        assert tokens[i] == reference_generate(model, prompt, NEW_TOKENS), f"request {i}"
    assert len({t for seq in tokens for t in seq}) > 20, "degenerate generations would make the check weak"


def test_the_window_of_mistral_changes_what_it_generates():
    """The Mistral scenario runs past its 24-token window: without the window transformers generates
    something else, so token equality above really checks the windowed attention and page release."""
    model = hf_models.model("mistral")
    workload = shared_prefix_workload(**WORKLOAD)
    info = ModelInfo.of_model(hf_models.exported("mistral"))
    assert info.uniform_window == 24 and min(len(p) for p in workload.prompts) > 24
    windowed = [reference_generate(model, p, NEW_TOKENS) for p in workload.prompts[:4]]
    model.config.sliding_window = None
    try:
        full = [reference_generate(model, p, NEW_TOKENS) for p in workload.prompts[:4]]
    finally:
        model.config.sliding_window = 24
    assert windowed != full


@pytest.mark.parametrize("settings", [dict(quant_bit=8, cache_layout=1), dict(quant_bit=4, cache_layout=3, page_size=8)],
                         ids=["int8-layout1", "int4-layout3-page8"])
def test_quantized_caches_equal_the_model_with_the_spec_quantized_cache(settings):
    """With a quantized cache the served model is the source model whose stored keys/values go through
    the spec's quantize/dequantize: greedy tokens equal that model's, and teacher-forced logits agree
    within 0.05 (a code on the rounding edge may flip by one where ORT's and torch's sums differ)."""
    path = hf_models.exported("llama", **settings)
    workload = shared_prefix_workload(**WORKLOAD)
    engine, tokens = serve(path, workload, num_pages=14 * 16 // settings.get("page_size", 16))
    assert_busy(engine.metrics())
    model, rounding = hf_models.model("llama"), stored_kv(ModelInfo.of_model(path))
    plain_gap = 0.0
    for i, prompt in enumerate(workload.prompts):
        assert tokens[i] == reference_generate(model, prompt, NEW_TOKENS, rounding), f"request {i}"
        served = np.array(engine.last_logits[i])
        assert np.abs(served - reference_logits(model, prompt, tokens[i], rounding)).max() < 0.05
        plain_gap = max(plain_gap, np.abs(served - reference_logits(model, prompt, tokens[i])).max())
    assert plain_gap > 0.05, "the quantization should be visible against the float32 model"


def test_the_oracle_stores_its_cache_through_the_rounding_and_warns_of_nothing():
    """The oracle hands transformers its cache under the name this transformers takes (an old name warns,
    a wrong one would be dropped): a rounding that zeroes every stored key and value changes both the
    generated tokens and the logits, and no FutureWarning is raised."""
    model, prompt = hf_models.model("llama"), list(range(40, 70))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        plain = reference_generate(model, prompt, 8)
        zeroed = reference_generate(model, prompt, 8, lambda x: x * 0)
        gap = np.abs(reference_logits(model, prompt, plain) - reference_logits(model, prompt, plain, lambda x: x * 0))
    assert plain != zeroed and gap.max() > 0.1


def test_a_float16_cache_stays_within_its_bound():
    """float16 rounds queries, keys, values and the attention output: teacher-forced logits (max |logit|
    about 5 for this model) stay within 0.05 of the source model with a float16-stored cache."""
    path = hf_models.exported("llama", dtype="float16", cache_layout=2, page_size=4, dynamo=False)
    workload = shared_prefix_workload(**WORKLOAD)
    engine, tokens = serve(path, workload, num_pages=14 * 4)
    model, rounding = hf_models.model("llama"), stored_kv(ModelInfo.of_model(path))
    for i, prompt in enumerate(workload.prompts):
        gap = np.abs(np.array(engine.last_logits[i]) - reference_logits(model, prompt, tokens[i], rounding)).max()
        assert gap < 0.05, f"request {i}: {gap}"


def test_tenant_salts_never_share_prefix_pages():
    path = hf_models.exported("llama")
    prompt = shared_prefix_workload(**WORKLOAD).prompts[0]
    engine = Engine(path, num_pages=32)
    engine.generate([prompt], 2, salts=["tenant-a"])
    engine.generate([prompt], 2, salts=["tenant-b"])
    assert engine.metrics()["prefix_hit_tokens"] == 0
    engine.generate([prompt], 2, salts=["tenant-a"])
    assert engine.metrics()["prefix_hit_tokens"] == (len(prompt) - 1) // 16 * 16


def test_a_failed_run_rolls_the_step_back_and_the_engine_recovers(monkeypatch):
    path = hf_models.exported("llama")
    workload = shared_prefix_workload(**WORKLOAD)
    engine = Engine(path, **TIGHT)
    calls = []

    def failing(real):
        def run(feeds, *changed):
            calls.append(1)
            if len(calls) == 7:
                raise RuntimeError("device lost")
            return real(feeds, *changed)
        return run

    for name in ("run", "run_greedy"):  # greedy steps take the second
        monkeypatch.setattr(engine.runner, name, failing(getattr(engine.runner, name)))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(workload.prompts, NEW_TOKENS, arrival_steps=workload.arrival_steps)
    engine.manager.check()
    assert not engine.manager.requests
    tokens = engine.generate(workload.prompts[:6], NEW_TOKENS)
    model = hf_models.model("llama")
    assert tokens == [reference_generate(model, p, NEW_TOKENS) for p in workload.prompts[:6]]


def test_streaming_shift_rotates_kept_keys_to_their_new_positions():
    """StreamingLLM with the key shift: one long request overflows a 4-page budget, pages are dropped and
    the kept keys rotated. Layer 0's keys depend only on the token and its position, so after the shift
    each kept slot must hold the key the model computes for its token at its new (cache) position."""
    import torch

    from kvcache_op.manager import StreamingPolicy

    path = hf_models.exported("llama")
    model = hf_models.model("llama")
    engine = Engine(path, num_pages=16, streaming=StreamingPolicy(sinks=4, budget_pages=4, mode="shift"))
    prompt = shared_prefix_workload(**WORKLOAD).prompts[1]
    fed, seen = [list(prompt)], []

    def snapshot(i, token):
        seen.append((retained(fed[i], engine.manager.computed(i)), engine.manager.page_table(i),
                     engine.manager.computed(i)))
        fed[i].append(token)

    tokens = engine.generate([prompt], 40, on_token=snapshot)[0]
    assert len(tokens) == 40 and len(prompt) + 40 > 4 * 16
    history, pages, computed = seen[-1]
    assert computed < len(prompt) + 39, "no page was dropped"
    from kvcache_op.reference.layout import canonical_view

    cache = canonical_view(engine.runner.cache.numpy(), engine.info.cache_layout)  # (L, 2, H, MaxT, Dh)
    layer0 = model.model.layers[0]
    with torch.no_grad():
        x = layer0.input_layernorm(model.model.embed_tokens(torch.tensor(history[:computed])))
        k = layer0.self_attn.k_proj(x).view(computed, 2, 16)
        cos, sin = model.model.rotary_emb(k, torch.arange(computed)[None])
        from transformers.models.llama.modeling_llama import rotate_half  # the model's own rotation
        want = (k * cos[0][:, None] + rotate_half(k) * sin[0][:, None]).numpy()
    slots = np.array([pages[p // 16] * 16 + p % 16 for p in range(computed)])
    got = cache[0, 0][:, slots].transpose(1, 0, 2)  # layer 0's keys: (positions, H, Dh)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def retained(fed: list, computed: int, sink_end: int = 16) -> list:
    """The tokens a StreamingLLM request's cache holds at positions [0, computed), from every token fed to
    it so far (the prompt, then each generated one but the newest): the sink page's tokens, then the most
    recent ones."""
    return fed[:computed] if computed <= sink_end else fed[:sink_end] + fed[len(fed) - (computed - sink_end):]


def test_streaming_reevaluate_tokens_are_the_model_over_the_retained_tokens():
    """Re-evaluation recomputes every kept key, so each generated token is exactly the model's greedy choice
    over the tokens the request retains (sinks, kept, fed) at contiguous positions, within the budget."""
    import torch

    from kvcache_op.manager import StreamingPolicy

    model = hf_models.model("llama")
    engine = Engine(hf_models.exported("llama"), num_pages=32, max_batch_tokens=16,
                    streaming=StreamingPolicy(sinks=4, budget_pages=4, mode="reevaluate"))
    workload = shared_prefix_workload(**WORKLOAD)
    prompts = [workload.prompts[0][:30], workload.prompts[1][:50], [3]]
    fed, seen = [list(p) for p in prompts], []

    def snapshot(i, token):
        seen.append((i, token, retained(fed[i], engine.manager.computed(i)), len(engine.manager.page_table(i))))
        fed[i].append(token)

    engine.generate(prompts, 60, on_token=snapshot)
    assert max(pages for *_, pages in seen) <= 4
    assert max(len(context) for _, _, context, _ in seen) <= 64 and any(len(c) < 50 for i, _, c, _ in seen if i == 1)
    with torch.no_grad():
        for i, token, context, _ in seen:
            assert int(model(torch.tensor([context])).logits[0, -1].argmax()) == token, f"request {i}"


@pytest.mark.parametrize("mode", ["shift", "reevaluate"])
def test_streaming_takes_a_prompt_longer_than_its_budget(mode):
    """StreamingLLM's point is contexts beyond the budget: a 100-token prompt with a 64-slot budget is fed in
    chunks that fit after the discard, whatever the token budget."""
    from kvcache_op.manager import StreamingPolicy

    engine = Engine(hf_models.exported("llama"), num_pages=16, max_batch_tokens=256,
                    streaming=StreamingPolicy(sinks=4, budget_pages=4, mode=mode))
    tokens = engine.generate([list(range(1, 101)), list(range(200, 280))], 6)
    assert [len(t) for t in tokens] == [6, 6]
    engine.manager.check()
    assert not engine.manager.requests


def test_reevaluate_discards_of_many_requests_in_one_step_stay_within_the_graphs_steps(tmp_path):
    """A "reevaluate" discard feeds the kept tokens again: three requests overflowing their budget in one step fed
    3 x 21 tokens to a graph whose rotary tables hold 48 positions, and ONNX Runtime failed the step. The budget
    counts what is re-fed now (a request left without room waits a step): every step fits, and each request's tokens
    are what it gets alone (its cache is a function of its tokens, however its steps are chunked)."""
    from kvcache_op.hf import export_model, tiny_model
    from kvcache_op.manager import StreamingPolicy

    path = export_model(tiny_model("llama", max_position_embeddings=48), tmp_path / "short.onnx", page_size=4)
    policy = StreamingPolicy(sinks=4, budget_pages=12, mode="reevaluate")
    prompts = [list(range(10, 26)), list(range(50, 66)), list(range(90, 106))]  # one prefill, decodes in lockstep
    engine = Engine(path, num_pages=64, streaming=policy)
    assert engine.runner.step_token_limit == engine.max_batch_tokens == 48
    run, fed = engine.runner.run_greedy, []  # greedy requests: every step's graph run

    def counted(feeds, *changed):
        fed.append(len(feeds["seqstarts"]) and int(feeds["seqstarts"][-1]))
        return run(feeds, *changed)
    engine.runner.run_greedy = counted
    together = engine.generate(prompts, 40)
    alone = [Engine(path, num_pages=64, streaming=policy).generate([p], 40)[0] for p in prompts]
    assert together == alone and max(fed) <= 48
    assert max(fed) > 21, "no step re-fed kept tokens beside others: the test checks nothing"


def test_a_pool_that_cannot_hold_a_window_or_a_streaming_budget_is_refused_before_any_token():
    """A request past its window (24, pages of 4) must hold 7 pages at once, one under StreamingLLM its budget: a
    smaller pool accepted the request and failed it mid-stream. Refused up front now, naming the pages; the
    smallest pool that holds them serves the tokens a large pool does."""
    from kvcache_op.manager import StreamingPolicy
    from kvcache_op.serving import SamplingParams

    prompt, windowed = list(range(1, 40)), hf_models.exported("mistral", page_size=4)
    assert Engine(windowed, num_pages=7).info.uniform_window == 24
    want = Engine(windowed, num_pages=64).generate([prompt], 60)
    with pytest.raises(ValueError, match=r"need 7 pages of 4 at once, more than num_pages=6"):
        Engine(windowed, num_pages=6).submit(prompt, SamplingParams(max_tokens=60))
    assert Engine(windowed, num_pages=6).generate([[1, 2, 3]], 5)  # a request that stays within 6 pages runs
    assert Engine(windowed, num_pages=7).generate([prompt], 60) == want
    policy = StreamingPolicy(sinks=4, budget_pages=6, mode="shift")
    rotary = hf_models.exported("llama", page_size=4)
    with pytest.raises(ValueError, match=r"need 6 pages of 4 at once, more than num_pages=5"):
        Engine(rotary, num_pages=5, streaming=policy).generate([prompt], 60)
    assert Engine(rotary, num_pages=6, streaming=policy).generate([prompt], 60) == \
        Engine(rotary, num_pages=64, streaming=policy).generate([prompt], 60)


def test_stop_ids_come_from_the_generation_config_too_and_its_sampling_defaults_are_ignored(tmp_path):
    """Chat checkpoints keep their end-of-turn id in the generation config; the engine stops there, and the
    oracle is plain greedy search whatever penalties the checkpoint's generation defaults carry."""
    from kvcache_op.hf import export_model, tiny_model

    model = tiny_model("llama", seed=5)
    prompt = list(range(10, 40))
    free = reference_generate(model, prompt, 12)
    model.generation_config.eos_token_id = [free[4]]
    model.generation_config.repetition_penalty = 1.3
    engine = Engine(export_model(model, tmp_path / "stops.onnx"), num_pages=8)
    assert engine.info.eos_token_ids == (free[4],)
    tokens = engine.generate([prompt], 12)[0]
    assert tokens == free[:free.index(free[4]) + 1] == reference_generate(model, prompt, 12)


def test_ignore_eos_generates_past_the_models_end_of_sequence_id_and_stop_token_ids_still_end_it(tmp_path):
    """ignore_eos drops the model's end-of-sequence ids from a request's ends, not the request's own
    stop_token_ids."""
    from kvcache_op.hf import export_model, tiny_model
    from kvcache_op.serving import SamplingParams

    model = tiny_model("llama", seed=5)
    prompt = list(range(10, 40))
    free = reference_generate(model, prompt, 12)
    eos, stop = free[4], free[9]
    assert free.index(eos) < free.index(stop)
    model.generation_config.eos_token_id = [eos]
    engine = Engine(export_model(model, tmp_path / "stops.onnx"), num_pages=8)
    assert engine.generate([prompt], 12)[0] == free[:free.index(eos) + 1]  # without it: ends at the model's id
    assert engine.generate([prompt], 12, params=SamplingParams(ignore_eos=True))[0] == free
    assert engine.generate([prompt], 12, params=SamplingParams(ignore_eos=True, stop_token_ids=[stop]))[0] == \
        free[:free.index(stop) + 1]


def test_a_window_model_takes_a_long_prompt_on_few_pages():
    """Only the window and one chunk are held: a 300-token prompt fits 6 pages once its chunks shrink."""
    model = hf_models.model("mistral")
    prompt = shared_prefix_workload(**WORKLOAD).prompts[0] * 6
    engine = Engine(hf_models.exported("mistral"), num_pages=6)
    assert engine.generate([prompt[:300]], 8) == [reference_generate(model, prompt[:300], 8)]


def test_admissions_count_the_pages_of_earlier_admissions_in_the_same_step():
    workload = shared_prefix_workload(**WORKLOAD)
    prompts = [p[:60] for p in workload.prompts[:6]]
    engine = Engine(hf_models.exported("llama"), num_pages=10, max_batch_tokens=256, max_running=8)
    tokens = engine.generate(prompts, 4)
    m = engine.metrics()
    assert m["preemptions"] == 0 and m["prompt_tokens"] == sum(map(len, prompts)), m
    assert tokens == [reference_generate(hf_models.model("llama"), p, 4) for p in prompts]


def test_bad_prompts_are_refused_before_any_work():
    engine = Engine(hf_models.exported("llama"), num_pages=8)
    with pytest.raises(ValueError, match=r"prompt 1: token 384 at index 2 is outside the vocabulary \[0, 384\)"):
        engine.generate([[1, 2], [3, 4, 384]], 2, arrival_steps=[0, 3])
    with pytest.raises(TypeError, match="prompt 0: token ids must be integers, got float64"):
        engine.generate([[1.7, 2.2]], 2)
    # Python ints beyond int64 (numpy keeps such a list as objects): the first outside the vocabulary is named
    with pytest.raises(ValueError, match=r"prompt 0: token 500 at index 0 is outside the vocabulary \[0, 384\)"):
        engine.generate([[500, 10 ** 30]], 2)
    with pytest.raises(ValueError, match=r"prompt 0: token -1 at index 1 is outside the vocabulary"):
        engine.generate([np.array([5, -1, 2 ** 64], dtype=object)], 2)
    assert engine.metrics()["steps"] == 0 and not engine.manager.requests
    # in-range ids held as objects are ids like any others
    assert engine.generate([np.array([5, 6, 7], dtype=object)], 2) == engine.generate([[5, 6, 7]], 2)


def test_a_late_arrival_does_not_spin_empty_steps():
    engine = Engine(hf_models.exported("llama"), num_pages=8)
    assert [len(t) for t in engine.generate([[1, 2, 3], [4, 5]], 3, arrival_steps=[0, 10**9])] == [3, 3]
    assert engine.metrics()["steps"] < 20


def test_qwen2_with_sliding_and_full_layers_and_no_prefix_caching(tmp_path):
    """Layers with different windows keep every page (no shared window to release by) and each layer's
    attention applies its own window; without prefix caching nothing is shared and the tokens are the same."""
    from kvcache_op.hf import export_model, tiny_model

    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    path = export_model(model, tmp_path / "mixed.onnx")
    assert ModelInfo.of_model(path).sliding_windows == (0, 8, 8)
    workload = shared_prefix_workload(count=6, vocab_size=384, seed=2)
    for caching in (True, False):
        engine = Engine(path, num_pages=40, prefix_caching=caching)
        tokens = engine.generate(workload.prompts, 10, arrival_steps=workload.arrival_steps)
        assert tokens == [reference_generate(model, p, 10) for p in workload.prompts]
        assert (engine.metrics()["prefix_hit_tokens"] > 0) == caching


def test_recorded_logits_are_the_choosing_requests_own_rows_beside_an_unfinished_prompt_chunk():
    """Under StreamingLLM a prompt's chunk is cut at its page budget: a long prompt admitted first feeds a chunk that
    chooses no token (the step's first row) while a short prompt ends in the same step (the second). The short
    request's recorded logits are its own: those of its lone run."""
    from kvcache_op.manager import StreamingPolicy

    path = hf_models.exported("llama", page_size=4)
    policy = StreamingPolicy(sinks=4, budget_pages=6)  # chunks of at most (6 - 1) * 4 = 20 tokens
    long_prompt, short_prompt = list(range(10, 70)), [5, 6, 7, 8, 9]
    together = Engine(path, num_pages=64, streaming=policy)
    tokens = together.generate([long_prompt, short_prompt], 3, record_logits=True)
    alone = Engine(path, num_pages=64, streaming=policy)
    assert alone.generate([short_prompt], 3, record_logits=True)[0] == tokens[1]
    got, want = np.array(together.last_logits[1]), np.array(alone.last_logits[0])
    assert got.shape == want.shape == (3, got.shape[-1])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
