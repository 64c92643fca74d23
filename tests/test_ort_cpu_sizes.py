"""Output sizes the caller can make impossible: H * num_repeat or the output's byte count past int64,
or a representable output too large to allocate. Each fails with a message naming the inputs and the
size, at session creation when H is static, else when run, and the cache stays byte-for-byte unchanged.

The expected messages are spelled out here (the reference raises the same ones: tests/invalid_calls.py).
Runs that make a wrapping kernel write through a wild pointer go through a subprocess.
"""

import os

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from isolated import assert_passes_isolated
from ort_helpers import model_for

I64_MAX = 2**63 - 1


def offset_call(heads=4, head_dim=8, kv=2):
    """A valid cache_mode 0 call: one sequence storing and loading ``kv`` tokens (float16)."""
    rng = np.random.default_rng(0)
    key = rng.standard_normal((kv, heads, head_dim)).astype(np.float16)
    cache = rng.standard_normal((16, 1, 2, heads, head_dim)).astype(np.float16)
    return dict(current_key=key, current_value=key + 1, seqstarts=np.array([0, kv]), kvstarts=np.array([0, kv]),
                cachestarts=np.array([3]), start_pos=np.array([0]), max_seqlen=np.array(kv), max_kvlen=np.array(kv),
                cache=cache)


def expect_run_error(inputs, attrs, message, symbolic_heads=True):
    feeds = {k: v.copy() for k, v in inputs.items()}
    before = feeds["cache"].tobytes()
    session = make_session(model_for(inputs, symbolic_heads=symbolic_heads, **attrs), intra_op_num_threads=1)
    with pytest.raises(Exception) as error:
        run_model(None, feeds, session=session)
    assert message in str(error.value), str(error.value)
    assert feeds["cache"].tobytes() == before, "a failed call changed the cache"


@pytest.mark.parametrize("heads, repeat", [(4, 2**62), (2, 2**62), (3, I64_MAX)])
def test_heads_times_num_repeat_past_int64_fails_at_session_creation(heads, repeat):
    inputs = offset_call(heads=heads)
    with pytest.raises(Exception) as error:
        make_session(model_for(inputs, num_repeat=repeat))
    assert heads_message(heads, repeat) in str(error.value)


# (H, num_repeat, why): H*num_repeat past int64, or the bytes of (kv_tokens=2, H*num_repeat, Dh=8) float16.
def heads_message(heads, repeat):
    return f"KeyValueCache output key would have H*num_repeat={heads}*{repeat} heads: H*num_repeat does not fit in int64"


def bytes_message(heads, repeat, kv, why):
    return (f"KeyValueCache output key would be (kv_tokens={kv}, H*num_repeat={heads}*{repeat}, Dh=8) elements of "
            f"float16: {why}")


# (H, num_repeat, kv_tokens, message) for (kv_tokens, H*num_repeat, Dh=8) float16 past int64. With no token the
# output is empty, but a shape whose other dims overflow is still refused (numpy could not hold it either).
RUN_TIME = [(4, 2**62, 2, heads_message(4, 2**62)), (2, 2**62, 0, heads_message(2, 2**62)),
            (4, 2**60, 2, bytes_message(4, 2**60, 2, "a single row would be 2^63 bytes or more")),
            (1, I64_MAX, 2, bytes_message(1, I64_MAX, 2, "a single row would be 2^63 bytes or more")),
            (1, 2**58, 2, bytes_message(1, 2**58, 2, "2^63 bytes or more")),
            (1, 2**59, 0, bytes_message(1, 2**59, 0, "a single row would be 2^63 bytes or more"))]


def check_run_time_size_error(heads, repeat, kv, message):
    """H symbolic in the model, so the kernel is the first to see H * num_repeat."""
    expect_run_error(offset_call(heads=heads, kv=kv), dict(num_repeat=repeat), message)


@pytest.mark.parametrize("heads, repeat, kv, message", RUN_TIME)
def test_output_size_past_int64_fails_at_run_time(heads, repeat, kv, message):
    assert_passes_isolated("test_ort_cpu_sizes", f"check_run_time_size_error({heads}, {repeat}, {kv}, {message!r})")


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under AddressSanitizer a failed operator new aborts instead of throwing bad_alloc")
def test_representable_but_unallocatable_output_names_shape_and_bytes():
    """2**40 loaded tokens from an 8 MiB page table (every page maps to the same read-only slots):
    (2**40, 256, 1) float16 is 2**49 bytes, more than any address space here."""
    page, pages = 2**20, 2**20
    cache = np.random.default_rng(1).standard_normal((page, 1, 2, 1, 1)).astype(np.float16)
    inputs = dict(current_key=np.zeros((0, 1, 1), np.float16), current_value=np.zeros((0, 1, 1), np.float16),
                  seqstarts=np.array([0, 0]), kvstarts=np.array([0, page * pages]),
                  cachestarts=np.zeros((1, pages), np.int64), start_pos=np.array([page * pages]),
                  max_seqlen=np.array(0), max_kvlen=np.array(page * pages), cache=cache)
    expect_run_error(inputs, dict(num_repeat=256, cache_mode=1, page_size=page),
                     f"KeyValueCache output key of shape ({2**40}, 256, 1) float16 ({2**49} bytes) could not be allocated",
                     symbolic_heads=False)
