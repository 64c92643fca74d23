"""Index inputs that alias the cache: the ORT CPU ops read every index input once, before any write.

Each case builds one byte buffer, makes the cache a view of it and makes an index input (``cachestarts``,
``start_pos``, ``seqstarts``; rotary's ``slots`` and ``cos``) an int64/float32 view INTO a cache row that
the call itself overwrites early, with bytes chosen so the overwrite plants a different value. ORT wraps
C-contiguous numpy arrays without copying (IOBinding with ``ortvalue_for``), so the kernel sees the
aliasing. The expected result is the reference's on copies of the inputs: final buffer bytes (the
overwritten index region included) and outputs.

A planted value that is in bounds but wrong makes a kernel that re-reads the index produce the wrong
bytes; a planted value far out of bounds makes it write through a wild pointer, so those variants run
in a subprocess (a crash fails the test instead of killing pytest).
"""

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, ortvalue_for, run_model, to_numpy
from kvcache_op.reference import key_cache_rotary_shift, key_value_cache
from isolated import assert_passes_isolated

FAR = 2**40  # a slot / position far outside any cache here


def int64_bits_as_float32(values) -> np.ndarray:
    """float32 whose bytes are the given int64 values (what a store must write to plant them)."""
    return np.array(values, np.int64).view(np.float32)


class KvLayout:
    """A layout-0 float32 cache (MaxT, 1, 2, 1, Dh) living in one byte buffer."""

    def __init__(self, max_t, head_dim):
        self.shape = (max_t, 1, 2, 1, head_dim)
        self.row_bytes = head_dim * 4
        self.buffer = np.zeros(max_t * 2 * self.row_bytes, np.uint8)
        self.cache = self.buffer.view(np.float32).reshape(self.shape)

    def key_row_int64(self, slot, count):
        """An int64 view of the first ``count`` elements of the key row of ``slot`` (no copy)."""
        start = slot * 2 * self.row_bytes
        return self.buffer[start:start + 8 * count].view(np.int64)


def run_kv(inputs, attrs):
    """(reference, ort) results: key, value and the final bytes of the cache buffer."""
    want = {k: np.array(v, copy=True) for k, v in inputs.items()}
    want_key, want_value = key_value_cache(**want, scale=None, **attrs)
    model = spec.make_model({**inputs, "scale": None}, **attrs)
    session = make_session(model, intra_op_num_threads=1)  # one thread: the stores run in token order
    got_key, got_value = run_model(model, inputs, session=session)
    return (want_key, want_value, want["cache"]), (got_key, got_value, inputs["cache"])


def assert_same(want, got):
    for name, w, g in zip(("key", "value", "cache"), want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), f"{name} differs from the reference on copies of the index inputs"


def paged_cachestarts_case(planted):
    """cache_mode 1: cachestarts [[0, 2]] lives in slot 0's key row; token 0 (slot 0) rewrites it to
    [[0, planted]], so a kernel that re-reads it stores tokens 2, 3 at slot ``planted``."""
    lay = KvLayout(max_t=16, head_dim=4)
    cachestarts = lay.key_row_int64(0, 2).reshape(1, 2)
    cachestarts[:] = [[0, 2]]
    key = np.random.default_rng(0).standard_normal((4, 1, 4)).astype(np.float32)
    key[0, 0] = int64_bits_as_float32([0, planted])
    inputs = dict(current_key=key, current_value=-key, seqstarts=np.array([0, 4]), kvstarts=np.array([0, 4]),
                  cachestarts=cachestarts, start_pos=np.array([0]), max_seqlen=np.array(4), max_kvlen=np.array(4),
                  cache=lay.cache)
    return inputs, dict(cache_mode=1, page_size=2)


def start_pos_case(planted):
    """cache_mode 0: start_pos [0, 0] lives in slot 0's key row; token 0 rewrites start_pos[1] to
    ``planted``, so a kernel that re-reads it stores sequence 1 at 8 + planted."""
    lay = KvLayout(max_t=16, head_dim=4)
    start_pos = lay.key_row_int64(0, 2)
    start_pos[:] = [0, 0]
    key = np.random.default_rng(1).standard_normal((4, 1, 4)).astype(np.float32)
    key[0, 0] = int64_bits_as_float32([0, planted])
    inputs = dict(current_key=key, current_value=key * 2, seqstarts=np.array([0, 2, 4]), kvstarts=np.array([0, 2, 4]),
                  cachestarts=np.array([0, 8]), start_pos=start_pos, max_seqlen=np.array(2), max_kvlen=np.array(2),
                  cache=lay.cache)
    return inputs, dict(cache_mode=0)


def seqstarts_case(planted):
    """cache_mode 0: seqstarts [0, 2, 4] lives in slot 0's key row; token 0 rewrites seqstarts[1] to
    ``planted``: 1 moves token 1 into sequence 1 (an unchecked position 2 follows), -2**40 sends it far away."""
    lay = KvLayout(max_t=16, head_dim=8)
    seqstarts = lay.key_row_int64(0, 3)
    seqstarts[:] = [0, 2, 4]
    key = np.random.default_rng(2).standard_normal((4, 1, 8)).astype(np.float32)
    key[0, 0] = int64_bits_as_float32([0, planted, 4, 0])
    inputs = dict(current_key=key, current_value=key + 1, seqstarts=seqstarts, kvstarts=np.array([0, 2, 4]),
                  cachestarts=np.array([0, 8]), start_pos=np.array([0, 0]), max_seqlen=np.array(2),
                  max_kvlen=np.array(2), cache=lay.cache)
    return inputs, dict(cache_mode=0)


def run_rotary(inputs, attrs):
    """(reference, ort) results: the output slots and the final bytes of the cache."""
    want = {k: np.array(v, copy=True) for k, v in inputs.items()}
    want_out = key_cache_rotary_shift(**want, scale=None, **attrs)
    session = make_session(spec.make_rotary_shift_model({**inputs, "scale": None}, **attrs), intra_op_num_threads=1)
    binding = session.io_binding()
    values = {name: ortvalue_for(array) for name, array in inputs.items()}  # views stay views: no copy
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("slots_out", "cpu")
    session.run_with_iobinding(binding)
    (got_out,) = [to_numpy(v) for v in binding.get_outputs()]
    return (want_out, want["cache"]), (got_out, inputs["cache"])


def rotary_slots_case(planted):
    """slots [1, 2] live in the first half of slot 1's key row. Rotating slot 1 with cos 0, sin 1 maps
    x[j] -> -x[j + 4]: the row's second half (cache data) is chosen so the rotation rewrites slots[1] to
    ``planted``, which a kernel that re-reads slots rotates next."""
    lay = KvLayout(max_t=16, head_dim=8)
    rng = np.random.default_rng(3)
    lay.cache[...] = rng.standard_normal(lay.shape).astype(np.float32)
    slots = lay.key_row_int64(1, 2)
    slots[:] = [1, 2]
    lay.cache[1, 0, 0, 0, 4:] = -int64_bits_as_float32([1, planted])
    cos = np.array([[0, 0, 0, 0], [0.5, 0.25, 1, 0]], np.float32)
    sin = np.array([[1, 1, 1, 1], [0.5, 1, 0, 1]], np.float32)
    return dict(cache=lay.cache, slots=slots, cos=cos, sin=sin), {}


def rotary_cos_case():
    """cos of the second slot lives in the key row of the first slot: a kernel that reads cos after
    rotating the first slot uses the rotated values."""
    lay = KvLayout(max_t=8, head_dim=8)
    lay.cache[...] = np.random.default_rng(4).standard_normal(lay.shape).astype(np.float32)
    start = 3 * 2 * lay.row_bytes  # key row of slot 3
    cos = lay.buffer[start:start + 32].view(np.float32).reshape(2, 4)
    cos[:] = [[0.6, 0.8, 1, 0], [0.28, 0.96, 0, 1]]
    sin = np.array([[0.8, 0.6, 0, 1], [0.96, 0.28, 1, 0]], np.float32)
    return dict(cache=lay.cache, slots=np.array([3, 5]), cos=cos, sin=sin), {}


KV_CASES = {"paged_cachestarts": paged_cachestarts_case, "start_pos": start_pos_case, "seqstarts": seqstarts_case}
IN_BOUNDS = {"paged_cachestarts": 8, "start_pos": 4, "seqstarts": 1, "rotary_slots": 5}
OUT_OF_BOUNDS = {"paged_cachestarts": FAR, "start_pos": FAR, "seqstarts": -FAR, "rotary_slots": FAR}


def check(name, planted):
    if name == "rotary_slots":
        want, got = run_rotary(*rotary_slots_case(planted))
        assert np.array_equal(got[0], want[0]), "output slots differ from the slots given"
        assert got[1].tobytes() == want[1].tobytes(), "cache differs from the reference on a copy of slots"
        return
    want, got = run_kv(*KV_CASES[name](planted))
    assert_same(want, got)


def test_the_index_views_really_alias_the_cache():
    """Guards the premise: the views share the cache's memory, and ORT wraps them without copying."""
    inputs, _ = paged_cachestarts_case(8)
    assert np.shares_memory(inputs["cachestarts"], inputs["cache"])
    value = ortvalue_for(inputs["cachestarts"])
    assert value.data_ptr() == inputs["cachestarts"].ctypes.data


@pytest.mark.parametrize("name", sorted(IN_BOUNDS))
def test_planted_in_bounds_index_is_ignored(name):
    check(name, IN_BOUNDS[name])


def test_cos_aliasing_the_cache_is_read_before_any_write():
    want, got = run_rotary(*rotary_cos_case())
    assert np.array_equal(got[0], want[0])
    assert got[1].tobytes() == want[1].tobytes(), "cache differs from the reference on a copy of cos"


@pytest.mark.parametrize("name", sorted(OUT_OF_BOUNDS))
def test_planted_out_of_bounds_index_is_ignored(name):
    """In a subprocess: a kernel that follows the planted index writes ~2**40 rows away and crashes."""
    assert_passes_isolated("test_ort_cpu_aliasing", f"check({name!r}, {OUT_OF_BOUNDS[name]!r})")
