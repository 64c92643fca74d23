"""The float16 / bfloat16 conversions of cpu/kv_types.h (what every kernel and the host runner use), bit for
bit against independent oracles over every input: all 2^32 float32 bit patterns to float16 and to bfloat16, all
65536 float16 and bfloat16 patterns to float32.

The conversions are compiled into a small library with the CPU kernel's flags (IEEE arithmetic, no contraction,
-O3: vectorized as in the kernel's loops), scalar with the CUDA host runner's (-O1; on a quarter of the float32
patterns and every range boundary, as it is several times slower), and, on x86-64, the eight-at-a-time SSE2
conversions of cpu/kv_sse2_convert.h that the generic CPU build uses. Oracles: numpy's float32 -> float16
cast (IEEE round to nearest even) where it is fast, float64 rounding of the scaled value for the float16
subnormal range, the IEEE rule itself (0 / inf) where every input of a range gives one result, and integer
round-to-nearest-even on the bits for bfloat16. NaN inputs are compared with the rule the kernels follow: the
quiet NaN 0x7e00 with the sign for float16; the top half with the quiet bit set for bfloat16; payloads kept
from float16 to float32.
"""

import ctypes
import pathlib
import platform

import numpy as np
import pytest
from native_build import build_library

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests/half_conversions.cc"
HEADERS = [ROOT / "cpu/kv_types.h", ROOT / "cpu/kv_sse2_convert.h"]
STRICT = ["-std=c++17", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", "-fno-fast-math",
          f"-I{ROOT / 'cpu'}"]
BUILDS = {"kernel": ["-O3", "-fno-trapping-math"], "runner": ["-O1"]}
if platform.machine().lower() in ("x86_64", "amd64"):  # SSE2 is part of x86-64: every such compiler has it
    BUILDS["sse2"] = ["-O3", "-fno-trapping-math", "-DHALF_CONVERSIONS_SSE2"]

CHUNK = 1 << 20  # float32 patterns per step; every range boundary below is a multiple of it
SIGN = 0x80000000
F16_ZERO_END = 0x33000000    # below 2^-25 (half the smallest subnormal): rounds to zero
F16_NORMAL_START = 0x38800000  # 2^-14, the smallest normal float16
F16_INF_START = 0x47800000   # 65536: every float from 65520 on rounds to inf; numpy covers 65504..65536
F32_INF = 0x7f800000
BOUNDARY_CHUNKS = {b + d for b in (F16_ZERO_END, F16_NORMAL_START, F16_INF_START, F32_INF) for d in (-CHUNK, 0)}
RUNNER_EVERY = 4


class Conversions:
    """The conversions of tests/half_conversions.cc in one build: the four every build has, and the SSE2
    build's shortcut for dequantized float16."""

    OUTPUTS = {"kv_float_to_half": np.uint16, "kv_float_to_bfloat16": np.uint16, "kv_half_to_float": np.uint32,
               "kv_bfloat16_to_float": np.uint32, "kv_rebiased_float_to_half": np.uint16}
    SSE2_ONLY = {"kv_rebiased_float_to_half"}

    def __init__(self, path: pathlib.Path, sse2: bool):
        lib = ctypes.CDLL(str(path))
        self.functions = {}
        for name in self.OUTPUTS:
            if name in self.SSE2_ONLY and not sse2:
                continue
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int64]
            fn.restype = None
            self.functions[name] = fn

    def __call__(self, name: str, first: int, count: int) -> np.ndarray:
        """The results (bits) of ``name`` for the ``count`` input bit patterns from ``first``."""
        out = np.empty(count, self.OUTPUTS[name])
        self.functions[name](first, out.ctypes.data, count)
        return out


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory):
    """Each build's conversions, by name: the oracles are computed once for all of them."""
    cache = getattr(request.config, "cache", None)  # reuse a build across runs when pytest's cache is on
    folder = cache.mkdir("half_conversions") if cache else tmp_path_factory.mktemp("half_conversions")
    return {name: Conversions(build_library(f"half_conversions-{name}", [SOURCE], HEADERS, STRICT + flags, folder),
                              sse2=name == "sse2")
            for name, flags in BUILDS.items()}


def assert_both_signs(builds, function: str, first: int, expected: np.ndarray) -> None:
    """``function`` of the CHUNK patterns from ``first`` and of their negatives: ``expected``, and ``expected``
    with the sign bit (every conversion here is symmetric in the sign). The runner build only on every
    RUNNER_EVERY-th chunk and on the chunks around each range boundary."""
    negative = expected | 0x8000
    for name, conversions in builds.items():
        if name == "runner" and (first // CHUNK) % RUNNER_EVERY and first not in BOUNDARY_CHUNKS:
            continue
        assert np.array_equal(conversions(function, first, CHUNK), expected), (name, hex(first))
        assert np.array_equal(conversions(function, first | SIGN, CHUNK), negative), (name, hex(first | SIGN))


def float16_expected(first: int) -> np.ndarray:
    """float16 bits of the CHUNK non-negative float32 patterns from ``first`` (all in one range)."""
    if first < F16_ZERO_END:
        return np.zeros(CHUNK, np.uint16)
    if first < F16_NORMAL_START:  # subnormal results (or the smallest normal): x / 2^-24, exact in float64,
        bits = np.arange(first, first + CHUNK, dtype=np.uint32)  # rounded half to even: the float16 bits
        return np.rint(bits.view(np.float32).astype(np.float64) * 2.0**24).astype(np.uint16)
    if first < F16_INF_START:  # 65520 and up round to inf: numpy warns of the overflow
        with np.errstate(over="ignore"):
            return np.arange(first, first + CHUNK, dtype=np.uint32).view(np.float32).astype(np.float16).view(np.uint16)
    if first < F32_INF:
        return np.full(CHUNK, 0x7C00, np.uint16)
    expected = np.full(CHUNK, 0x7E00, np.uint16)  # NaN
    if first == F32_INF:
        expected[0] = 0x7C00
    return expected


def test_float16_oracle_agrees_with_numpy_on_a_sample_of_every_range():
    """The range rules of float16_expected against numpy's own cast (slow below 2^-14, so sampled)."""
    firsts = set(range(0, F32_INF + CHUNK, CHUNK * 61)) | BOUNDARY_CHUNKS
    for first in sorted(firsts):
        sample = np.arange(first, first + CHUNK, 4099, dtype=np.uint32)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            numpy_bits = sample.view(np.float32).astype(np.float16).view(np.uint16)
        finite = sample < F32_INF + 1
        assert np.array_equal(float16_expected(first)[sample - first][finite], numpy_bits[finite]), hex(first)
    # 2^-25 and above, the largest subnormal and the smallest normal input, 65504 + just under / at half an ulp
    for edge in (0x33000000, 0x33000001, 0x387FEFFF, 0x387FF000, 0x387FFFFF, 0x38800000, 0x477FEFFF, 0x477FF000,
                 0x477FFFFF, 0x47800000):
        value = np.array([edge], np.uint32)
        with np.errstate(over="ignore", under="ignore"):
            numpy_bits = value.view(np.float32).astype(np.float16).view(np.uint16)
        first = edge - edge % CHUNK
        assert float16_expected(first)[edge - first] == numpy_bits[0], hex(edge)


def test_float_to_half_on_every_float32(builds):
    for first in range(0, 1 << 31, CHUNK):
        assert_both_signs(builds, "kv_float_to_half", first, float16_expected(first))


F16_REBIASED_END = 0x47000000  # 32768: the largest magnitude sse2::HalvesFromRebiasedNormals takes


@pytest.mark.skipif("sse2" not in BUILDS, reason="SSE2 conversions exist on x86-64 only")
def test_rebiased_float_to_half_on_its_whole_domain(builds):
    """HalvesFromRebiasedNormals (dequantization's shortcut for float16 outputs) against the same oracle, over
    every float32 it may be given: zero and every magnitude from 2^-14 to 32768, both signs."""
    sse2 = builds["sse2"]
    for first in range(F16_NORMAL_START, F16_REBIASED_END, CHUNK):
        expected = float16_expected(first)
        assert np.array_equal(sse2("kv_rebiased_float_to_half", first, CHUNK), expected), hex(first)
        assert np.array_equal(sse2("kv_rebiased_float_to_half", first | SIGN, CHUNK), expected | 0x8000), hex(first)
    for edge, half in ((0, 0), (SIGN, 0x8000), (F16_REBIASED_END, 0x7800), (F16_REBIASED_END | SIGN, 0xF800)):
        assert sse2("kv_rebiased_float_to_half", edge, 8)[0] == half, hex(edge)


# Rounding to nearest even of a float32 to its top 16 bits: up by one where the dropped half is above the
# halfway point 0x8000, or at it with an odd top half. Row t % 2 of ROUND_UP: the increment for each dropped half.
DROPPED = np.arange(1 << 16, dtype=np.uint32)
ROUND_UP = np.stack([DROPPED > 0x8000, DROPPED >= 0x8000]).astype(np.uint16)


def bfloat16_expected(first: int) -> np.ndarray:
    """bfloat16 bits of the CHUNK non-negative float32 patterns from ``first``: a row per top half, across every
    dropped half; NaN: the top half with the quiet bit."""
    top = (first >> 16) + np.arange(CHUNK >> 16, dtype=np.uint16)[:, None]
    expected = top + ROUND_UP[top[:, 0] % 2]
    if first + CHUNK > F32_INF:
        nan = (top.astype(np.uint32) << 16 | DROPPED) > F32_INF
        expected = np.where(nan, top | 0x40, expected)
    return expected.ravel()


def test_float_to_bfloat16_on_every_float32(builds):
    for first in range(0, 1 << 31, CHUNK):
        assert_both_signs(builds, "kv_float_to_bfloat16", first, bfloat16_expected(first))


def test_half_to_float_on_every_float16(builds):
    halves = np.arange(1 << 16).astype(np.uint16)
    expected = halves.view(np.float16).astype(np.float32).view(np.uint32)
    nan = (halves & 0x7FFF) > 0x7C00  # payload kept as is (numpy may set the quiet bit)
    sign = (halves.astype(np.uint32) & 0x8000) << 16
    expected = np.where(nan, sign | 0x7F800000 | ((halves.astype(np.uint32) & 0x3FF) << 13), expected)
    for name, conversions in builds.items():
        assert np.array_equal(conversions("kv_half_to_float", 0, 1 << 16), expected), name


def test_bfloat16_to_float_on_every_bfloat16(builds):
    expected = np.arange(1 << 16, dtype=np.uint32) << 16  # a bfloat16 is the top half of a float32, NaN too
    for name, conversions in builds.items():
        assert np.array_equal(conversions("kv_bfloat16_to_float", 0, 1 << 16), expected), name
