"""The references compute the call on copies of their inputs (spec: index inputs are read once; the numpy reference
works on values): an input that is a view of cache rows the call overwrites gives what its copy gives."""

import numpy as np

from kvcache_op.reference import key_value_cache, multi_head_cache_attention
from processes import run_script


def _cache_attention(view_of_cache: bool, what: str):
    """A chunk of 3 queries (causal unless decoding_batches reads 1) over 3 keys, or 1 query over 2: ``what``
    (decoding_batches or query) is a view of the key row of slot 0 or 1, which the call stores over."""
    cache = np.zeros((8, 1, 2, 1, 2), np.float32)  # layout 0: (MaxT, L, 2, H, Dh)
    if what == "decoding_batches":
        keys = np.zeros((3, 1, 2), np.float32)
        keys[0, 0, 0] = np.array(1, np.uint32).view(np.float32)  # stored over slot 0: reads as int64 1 there
        decoding = cache[0, 0, 0, 0].view(np.int64).reshape(())
        query = np.zeros((3, 1, 2), np.float32)
        lengths = dict(seqstarts=np.array([0, 3]), kvstarts=np.array([0, 3]), start_pos=np.array([0]),
                       max_seqlen=np.array(3), max_kvlen=np.array(3))
        values = np.array([[[1, 1]], [[2, 2]], [[3, 3]]], np.float32)
    else:
        cache[0, 0] = [[[1.0, 0.0]], [[3.0, 3.0]]]  # position 0's key and value
        keys = np.array([[[5.0, 0.0]]], np.float32)
        decoding = np.array(1, np.int64)
        query = cache[1:2, 0, 0]  # (1, 1, 2): slot 1's key row, stored over by position 1
        lengths = dict(seqstarts=np.array([0, 1]), kvstarts=np.array([0, 2]), start_pos=np.array([1]),
                       max_seqlen=np.array(1), max_kvlen=np.array(2))
        values = np.array([[[1.0, 1.0]]], np.float32)
    inputs = dict(query=query, current_key=keys, current_value=values, cachestarts=np.array([0]),
                  decoding_batches=decoding, cache=cache, **lengths)
    if not view_of_cache:
        inputs = {k: np.array(v, copy=True) for k, v in inputs.items()}
    return multi_head_cache_attention(**inputs, num_heads=1, head_dim=2, softmax_scale=1.0)


def test_cache_attention_reads_decoding_batches_before_it_stores():
    want = _cache_attention(False, "decoding_batches")
    assert want[0, 0, 0] == 1.0 and want[2, 0, 0] != 1.0  # causal: query 0 sees key 0 alone
    assert _cache_attention(True, "decoding_batches").tobytes() == want.tobytes()


def test_cache_attention_reads_its_query_before_it_stores():
    want = _cache_attention(False, "query")
    assert _cache_attention(True, "query").tobytes() == want.tobytes()


def test_key_value_cache_stores_the_values_it_was_given_when_they_are_a_view_of_stored_rows():
    """current_value is a view of the key rows the call stores (a call a backend with buffers refuses): the
    reference's values are those the call began with, not the keys stored over them."""

    def values(view_of_cache: bool):
        cache = np.zeros((1, 2, 1, 4, 2), np.float32)  # layout 3: (L, 2, H, MaxT, Dh)
        cache[0, 0, 0] = np.arange(8, dtype=np.float32).reshape(4, 2) + 100
        current_value = cache[0, 0, 0, 0:2][:, None, :]
        if not view_of_cache:
            current_value = current_value.copy()
        _, value = key_value_cache(np.array([[[1, 1]], [[2, 2]]], np.float32), current_value, np.array([0, 2]),
                                   np.array([0, 2]), np.array([0]), np.array([0]), np.array(2), np.array(2), cache,
                                   cache_layout=3)
        return value[:, 0, :].tolist()

    assert values(True) == values(False) == [[100.0, 101.0], [102.0, 103.0]]


def test_outputs_that_cannot_be_allocated_are_a_key_value_cache_error_with_the_cache_unchanged():
    """Spec: outputs whose size fits in int64 but cannot be allocated are an error too (the reference's own error,
    which the kit expects of a refused call, not numpy's MemoryError), and nothing is written."""
    script = """
        import resource
        import numpy as np
        from kvcache_op.reference import KeyValueCacheError, key_value_cache

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # the outputs: 4 TiB
        cache = np.zeros((4, 1, 2, 1, 2), np.float32)
        one = np.ones((1, 1, 2), np.float32)
        try:
            key_value_cache(one, one, np.array([0, 1]), np.array([0, 1]), np.array([0]), np.array([0]), np.array(1),
                            np.array(1), cache, num_repeat=2**38)
        except KeyValueCacheError as error:
            assert "could not be allocated" in str(error), error
        else:
            raise AssertionError("4 TiB of outputs were allocated")
        assert not cache.any()
        print("ok")
    """
    child = run_script(script)
    assert child.returncode == 0 and "ok" in child.stdout, (child.returncode, child.stdout, child.stderr[-2000:])
