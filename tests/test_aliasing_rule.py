"""The aliasing rule (no slot stored twice; a stored slot loaded only by its own sequence at its own
position) on index inputs drawn to collide: small caches, pages placed anywhere, in both cache modes. The
library checks stores and loads as runs of slots; the reference checks slot by slot. Both must accept
the same calls and reject the rest with the same message."""

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from kvcache_op.capi import c_api
from kvcache_op.reference import KeyValueCacheError, key_value_cache


@st.composite
def colliding_calls(draw):
    mode = draw(st.sampled_from([0, 1]))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8])) if mode else 1
    batch = draw(st.integers(1, 4))
    max_t = draw(st.integers(8, 64))
    seq_len = [draw(st.integers(0, 6)) for _ in range(batch)]
    start_pos = [draw(st.integers(0, 12)) for _ in range(batch)]
    kv_len = [draw(st.integers(0, p + n)) for p, n in zip(start_pos, seq_len)]
    if mode == 0:
        touched = [max(p + n if n else k, 1) for p, n, k in zip(start_pos, seq_len, kv_len)]
        cachestarts = np.array([draw(st.integers(0, max_t - t)) if t <= max_t else 0 for t in touched], np.int64)
    else:
        max_p = (18 + page_size - 1) // page_size
        # Distinct pages of a shuffled pool, then a few entries moved anywhere (overlapping pages, starts
        # that are not multiples of page_size): collisions of every kind, and clean calls too.
        pool = draw(st.permutations(range(0, max_t - page_size + 1, page_size)))
        table = [pool[k % len(pool)] for k in range(batch * max_p)]
        for _ in range(draw(st.integers(0, 3))):
            table[draw(st.integers(0, len(table) - 1))] = draw(st.integers(0, max_t - page_size))
        cachestarts = np.array(table, np.int64).reshape(batch, max_p)
    seqstarts = np.concatenate([[0], np.cumsum(seq_len)]).astype(np.int64)
    kvstarts = np.concatenate([[0], np.cumsum(kv_len)]).astype(np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = int(seqstarts[-1])
    inputs = dict(current_key=rng.standard_normal((tokens, 1, 4)).astype(np.float32),
                  current_value=rng.standard_normal((tokens, 1, 4)).astype(np.float32),
                  seqstarts=seqstarts, kvstarts=kvstarts, cachestarts=cachestarts,
                  start_pos=np.array(start_pos, np.int64), max_seqlen=np.array(max(seq_len), np.int64),
                  max_kvlen=np.array(max(kv_len), np.int64),
                  cache=rng.standard_normal((max_t, 1, 2, 1, 4)).astype(np.float32))
    return inputs, dict(num_layer=1, layer_idx=0, cache_mode=mode, page_size=page_size)


def outcome(run, inputs, attrs):
    fresh = {k: v.copy() for k, v in inputs.items()}
    try:
        key, value = run(**fresh, **attrs)
    except KeyValueCacheError as error:
        return str(error), fresh["cache"].tobytes()
    return None, key.tobytes() + value.tobytes() + fresh["cache"].tobytes()


@settings(max_examples=300)
@given(colliding_calls())
def test_library_and_reference_agree_on_colliding_indices(call):
    inputs, attrs = call
    want_message, want_bytes = outcome(key_value_cache, inputs, attrs)
    event(f"mode {attrs['cache_mode']}: " + ("valid" if want_message is None else " ".join(want_message.split()[3:6])))
    got_message, got_bytes = outcome(c_api.key_value_cache, inputs, attrs)
    assert got_message == want_message
    assert got_bytes == want_bytes


def test_pages_and_lengths_near_int64s_limit_are_counted_without_overflow():
    """A page of 2^61 slots and a load length of 2^63 - 1: counting the load runs must not overflow int64 on the
    way (the sanitizer build aborts on signed overflow). Every page starts at slot 0, so the store at position
    2^63 - 2 (page 3) lands on the slot that position 2^61 - 2 (page 0) loads."""
    inputs = dict(current_key=np.zeros((1, 1, 1), np.float32), current_value=np.zeros((1, 1, 1), np.float32),
                  seqstarts=np.array([0, 1], np.int64), kvstarts=np.array([0, 2**63 - 1], np.int64),
                  cachestarts=np.zeros((1, 4), np.int64), start_pos=np.array([2**63 - 2], np.int64),
                  max_seqlen=np.array(1, np.int64), max_kvlen=np.array(2**63 - 1, np.int64))
    args = c_api.HostBuffers()
    tensors = [args.tensor(n, inputs[n]) for n in c_api.KV_INPUTS[:8]]
    # A cache of 2^62 float32 elements is only described: validation reads no cache memory.
    placeholder = np.zeros(1, np.float32)
    tensors += [c_api.Tensor(c_api.ONNX_TYPES[placeholder.dtype], (2**61, 1, 2, 1, 1), placeholder.ctypes.data),
                c_api.ABSENT]
    with pytest.raises(KeyValueCacheError, match=f"slot {2**61 - 2} is stored by sequence 0 position {2**63 - 2} and "
                                                  f"loaded in the same call by sequence 0 position {2**61 - 2};"):
        c_api.output_shape(tensors, num_layer=1, layer_idx=0, cache_mode=1, page_size=2**61)
