"""The worked examples of spec/KeyValueCache.md, checked against the reference."""

import numpy as np

from kvcache_op.reference import key_value_cache, quantize


def test_int8_worked_example():
    codes, scale = quantize(np.array([[0.5, -1.0, 0.25, 2.0]], np.float32), 8, 4, np.float32)
    assert codes.tolist() == [[32, -64, 16, 127]]
    assert scale[0, 0] == np.float32(2.0) / np.float32(127)


def test_offset_mode_worked_example():
    history = np.arange(8 * 2 * 2, dtype=np.float16).reshape(8, 1, 2, 1, 2) + 100
    cache = history.copy()
    current = np.array([[[1, 2]], [[3, 4]], [[5, 6]]], np.float16)
    key, value = key_value_cache(current, -current, np.array([0, 2, 3]), np.array([0, 2, 5]), np.array([0, 4]),
                                 np.array([0, 2]), np.array(2), np.array(3), cache)
    expected = [[1, 2], [3, 4], history[4, 0, 0, 0].tolist(), history[5, 0, 0, 0].tolist(), [5, 6]]
    assert key[:, 0].tolist() == expected
    assert cache[6, 0, 1, 0].tolist() == [-5, -6]


def test_paged_mode_worked_example():
    cache = np.arange(16 * 2, dtype=np.float32).reshape(16, 1, 2, 1, 1)
    table = np.array([[8, 0, -1]])
    key, _ = key_value_cache(np.full((1, 1, 1), -7, np.float32), np.zeros((1, 1, 1), np.float32),
                             np.array([0, 1]), np.array([0, 6]), table, np.array([5]), np.array(1), np.array(6),
                             cache, cache_mode=1, page_size=4)
    slots = [8, 9, 10, 11, 0, 1]
    assert key[:5, 0, 0].tolist() == [float(2 * s) for s in slots[:5]]
    assert key[5, 0, 0] == -7 and cache[1, 0, 0, 0, 0] == -7


def test_gqa_repeat_interleave_order():
    cache = np.zeros((4, 1, 2, 2, 1), np.float32)
    current = np.array([[[10], [20]]], np.float32)
    key, _ = key_value_cache(current, current, np.array([0, 1]), np.array([0, 1]), np.array([0]), np.array([0]),
                             np.array(1), np.array(1), cache, num_repeat=2)
    assert key[0, :, 0].tolist() == [10, 10, 20, 20]
