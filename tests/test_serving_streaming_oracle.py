"""StreamingLLM in the engine against an oracle written on transformers alone: the model run one token at a time
over its own DynamicCache, edited by hand as the documented policy says (sinks rounded up to whole pages, a budget
of pages; on overflow half of the pages after the sinks are dropped; with the key shift the kept keys rotate back by
the dropped count, on the model's own rotary dims, partial rotary included). The engine's greedy tokens must be the
oracle's."""

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import torch  # noqa: E402

import hf_models  # noqa: E402
from kvcache_op.manager import StreamingPolicy  # noqa: E402
from kvcache_op.serving import Engine  # noqa: E402

PAGE, SINKS, BUDGET, NEW = 4, 3, 5, 30


def _rotated(keys, delta: int, inv_freq):
    """``keys`` (B, H, T, Dh) rotated by ``delta`` positions: rotate-half pairs (j, j + R/2) of the first R dims."""
    half = len(inv_freq)
    angle = delta * inv_freq.double()
    cos, sin = torch.cos(angle).to(keys.dtype), torch.sin(angle).to(keys.dtype)
    out = keys.clone()
    x1, x2 = keys[..., :half], keys[..., half:2 * half]
    out[..., :half], out[..., half:2 * half] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return out


@torch.no_grad()
def _oracle(model, prompt: list, mode: str) -> list:
    inv_freq = next(m.inv_freq for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor))
    sink_end = -(-SINKS // PAGE) * PAGE
    cache, length, fed, stream, out, kept = None, 0, 0, list(prompt), [], []
    while len(out) < NEW:
        if -(-(length + 1) // PAGE) > BUDGET:  # the next token needs a page past the budget
            held = -(-length // PAGE)
            dropped = min((held - sink_end // PAGE + 1) // 2 * PAGE, length - sink_end)
            survivors = kept[sink_end + dropped:]
            kept = kept[:sink_end]
            for layer in cache.layers:
                keys, values = layer.keys[:, :, :sink_end], layer.values[:, :, :sink_end]
                if mode == "shift":
                    keys = torch.cat([keys, _rotated(layer.keys[:, :, sink_end + dropped:], -dropped, inv_freq)], 2)
                    values = torch.cat([values, layer.values[:, :, sink_end + dropped:]], 2)
                layer.keys, layer.values = keys, values
            length = sink_end
            if mode == "shift":
                kept, length = kept + survivors, sink_end + len(survivors)
            else:  # the kept tokens fed again at their new positions
                for again in survivors:
                    model(input_ids=torch.tensor([[again]]), position_ids=torch.tensor([[length]]),
                          cache_position=torch.tensor([length]), past_key_values=cache, use_cache=True)
                    kept.append(again)
                    length += 1
        result = model(input_ids=torch.tensor([[stream[fed]]]), position_ids=torch.tensor([[length]]),
                       cache_position=torch.tensor([length]), past_key_values=cache, use_cache=True)
        cache, length = result.past_key_values, length + 1
        kept.append(stream[fed])
        fed += 1
        if fed >= len(prompt):
            out.append(int(result.logits[0, -1].argmax()))
            stream.append(out[-1])
    return out


@pytest.mark.parametrize("family, mode", [("llama", "shift"), ("gpt_neox", "shift"), ("gpt_neox", "reevaluate")])
def test_streaming_tokens_are_the_oracles(family, mode):
    """gpt_neox rotates half of each head (partial rotary): its key shift must turn those dims alone."""
    model = hf_models.model(family)
    prompts = [list(range(5, 14)), list(range(5, 35))]  # one within the budget at first, one past it
    engine = Engine(hf_models.exported(family, page_size=PAGE), num_pages=64,
                    streaming=StreamingPolicy(SINKS, BUDGET, mode))
    assert engine.generate(prompts, NEW) == [_oracle(model, prompt, mode) for prompt in prompts]


def test_a_budget_past_the_models_positions_is_refused():
    """Cache positions run up to the budget: one past the model's max_positions would feed positions it has no
    rotary angles for (ONNX Runtime's RotaryEmbedding failed mid-run)."""
    path = hf_models.exported("llama", page_size=PAGE)
    most = Engine(path, num_pages=8).info.max_positions // PAGE
    with pytest.raises(ValueError, match=f"more than the model's max_positions .* give at most {most} pages"):
        Engine(path, num_pages=8, streaming=StreamingPolicy(SINKS, most + 1))
    assert Engine(path, num_pages=8, streaming=StreamingPolicy(SINKS, most)).max_context is None
