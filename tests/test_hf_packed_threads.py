"""Packed forwards of one model from two threads: the attention implementation they switch is the shared model's,
so they run one at a time. Forced to overlap (the first holds in its first layer until the second is inside or a
while has passed; the second holds in its first layer until the first has returned), each gives what it gives
alone, and the model's own attention is back afterwards."""

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_overlapping_packed_forwards_of_one_model_each_give_their_own_answer():
    from kvcache_op.hf import CacheSettings, PackedDecoder, tiny_model
    from kvcache_op.hf.export import example_inputs

    torch.manual_seed(0)
    model = tiny_model("llama", seed=0).eval()
    original = model.config._attn_implementation
    decoder = PackedDecoder(model, CacheSettings(page_size=4, cache_layout=1, dtype=torch.float32)).eval()

    def forward():
        feeds = example_inputs(decoder)
        with torch.no_grad():
            return decoder(**feeds), feeds["cache"]

    want_logits, want_cache = forward()
    first_inside, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()
    roles = {}

    def hold(module, args):
        role = roles.get(threading.get_ident())
        if role == "first":
            first_inside.set()
            second_inside.wait(2.0)  # never set while the first holds the model: it waits the while out
        elif role == "second":
            second_inside.set()
            first_done.wait(10.0)

    hook = model.model.layers[0].register_forward_pre_hook(hold)
    results, errors = {}, []

    def run(role):
        roles[threading.get_ident()] = role
        try:
            results[role] = forward()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            if role == "first":
                first_done.set()

    try:
        first = threading.Thread(target=run, args=("first",))
        first.start()
        assert first_inside.wait(10.0)
        second = threading.Thread(target=run, args=("second",))
        second.start()
        first.join(30.0)
        second.join(30.0)
    finally:
        hook.remove()
    assert not errors, errors
    for role in ("first", "second"):
        logits, cache = results[role]
        assert torch.equal(logits, want_logits) and torch.equal(cache, want_cache), role
    assert model.config._attn_implementation == original
