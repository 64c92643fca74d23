"""The AVX-512 quantizer's division-free codes (cpu/kv_cpu_quant_avx512.h, QuantizeCodes16ByReciprocal): for
float16 and bfloat16 inputs and scales, every stored scale and every input whose quotient lies within (-127.5,
127.5) (the inputs far below the scale, whose codes are 0, sampled), the code of the product with the scale's
reciprocal against rint(x / s) from an IEEE division, rounding half to even. The products are taken only for such
operands (float32 ones keep the division), so this covers every case they meet. Built with the AVX-512 build's
flags; skipped with the reason where the processor cannot run it."""

import ctypes
import pathlib

import pytest
from cpu_kernels import CPU_KERNELS, build_flags
from native_build import build_library

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests/reciprocal_codes.cc"
HEADERS = [ROOT / "cpu" / name for name in ("kv_cpu_quant_avx512.h", "kv_cpu_quant_avx2.h", "kv_cpu_rows.h",
                                            "kv_cpu_codes.h", "kv_quant.h", "kv_types.h")]
STRICT = ["-std=c++17", "-fPIC", "-shared", "-O2", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off",
          "-fno-fast-math", f"-I{ROOT / 'cpu'}"]
TYPES = {"float16": 0, "bfloat16": 1}
AVX512 = next(k for k in CPU_KERNELS if k.id == "avx512")


@pytest.fixture(scope="module")
def library(request, tmp_path_factory):
    """The test library of the AVX-512 build (skipped with the reason where the processor cannot run it)."""
    if AVX512.marks:
        pytest.skip(AVX512.marks[0].kwargs["reason"])
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("reciprocal_codes") if cache else tmp_path_factory.mktemp("reciprocal_codes")
    flags = STRICT + build_flags("avx512")
    lib = ctypes.CDLL(str(build_library("reciprocal_codes-avx512", [SOURCE], HEADERS, flags, folder)))
    lib.reciprocal_codes_check.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                           ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_float)]
    lib.reciprocal_codes_check.restype = ctypes.c_int64
    return lib


@pytest.mark.parametrize("t1", TYPES)
@pytest.mark.parametrize("t3", TYPES)
def test_products_with_the_reciprocal_give_the_divisions_codes(library, t1, t3):
    """No pair gives another code than the division's; the pairs checked include every exact tie (x an odd
    multiple of s / 2) the types can hold, and every input next to one."""
    checked, x, s = ctypes.c_int64(), ctypes.c_float(), ctypes.c_float()
    wrong = library.reciprocal_codes_check(TYPES[t1], TYPES[t3], ctypes.byref(checked), ctypes.byref(x), ctypes.byref(s))
    assert checked.value > 10**6, f"only {checked.value} pairs checked"
    assert wrong == 0, f"{wrong} of {checked.value} codes differ from the division's, the first at x={x.value!r}, s={s.value!r}"
