"""The ORT CPU op agrees bit for bit with the reference: outputs, cache and scale, every attribute value."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpu_kernels import CPU_KERNELS, use_cpu_kernel
from ort_helpers import assert_same_bits, ort_result, reference_result
from strategies import COMBINATIONS, calls_for


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_ort_cpu_matches_reference(combo, kernel, monkeypatch):
    """Every attribute combination, in every kernel build (AVX-512, AVX2+F16C, generic)."""
    use_cpu_kernel(monkeypatch, kernel)

    @given(calls_for(combo, max_batch=5), st.sampled_from((1, 2)))
    def check(case, threads):
        want = reference_result(case.inputs, case.attributes)
        got = ort_result(case.inputs, case.attributes, intra_op_num_threads=threads)
        assert_same_bits(got, want)

    check()


@pytest.mark.parametrize("quant_bit,t1,t3", [(0, "float16", "float32"), (8, "bfloat16", "float16"), (4, "float32", "float32")])
@pytest.mark.parametrize("mode,layout", [(0, 0), (1, 3), (1, 1), (0, 2)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_ort_cpu_matches_reference_on_large_batches(quant_bit, t1, t3, mode, layout, threads, kernel, monkeypatch):
    """Big enough for many parallel tasks (store and gather are split in 64-token tasks); every kernel
    build (AVX-512, AVX2+F16C, generic) gives the reference's bits."""
    use_cpu_kernel(monkeypatch, kernel)
    import numpy as np

    from kvcache_op.validation.cases import Seq, build

    rng = np.random.default_rng(quant_bit * 100 + mode * 10 + layout)
    seqs = [Seq(int(rng.integers(0, 150)), int(rng.integers(0, 40))) for _ in range(24)]
    case = build(f"large-{quant_bit}-{mode}-{layout}", seqs, heads=4, head_dim=32, quant_bit=quant_bit,
                 quant_group=8, num_repeat=2, cache_mode=mode, cache_layout=layout, page_size=16, t1=t1, t3=t3)
    want = reference_result(case.inputs, case.attributes)
    assert want[0].shape[0] > 64 * 8
    assert_same_bits(ort_result(case.inputs, case.attributes, intra_op_num_threads=threads), want)
