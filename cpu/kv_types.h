// Element types of the op and the exact conversions the spec prescribes (float32 <-> float16 /
// bfloat16, round to nearest even). Header-only; usable from host C++ and CUDA device code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KV_HD __host__ __device__ __forceinline__
#define KV_HD_ALWAYS KV_HD
#else
#define KV_HD inline
#define KV_HD_ALWAYS inline __attribute__((always_inline))
#endif

namespace kvcache {

// Values are ONNX TensorProto element types (so they match ONNXTensorElementDataType).
enum class Elem : int32_t {
  kFloat32 = 1,
  kInt8 = 3,
  kInt32 = 6,
  kInt64 = 7,
  kFloat16 = 10,
  kFloat64 = 11,
  kBFloat16 = 16,
  kInt4 = 22,
};

const char* ElemName(int32_t onnx_type);

KV_HD uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

KV_HD float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// The conversions below have no branches: each computes its candidate results and picks one with integer
// compares and ternaries (selects), so that compilers vectorize loops over them without F16C and the like (the
// selects become and/andnot/or or blends). Out-of-range cases are folded into the arithmetic where that saves a
// select. Magnitudes (the sign bit cleared) are compared as int32_t, the integer compare SSE2 has. They rely on
// IEEE float arithmetic (no -ffast-math, no flush to zero); tests/test_half_conversions.py checks every input.

// float32 -> float16, round to nearest even, overflow to inf, subnormals kept, NaN -> quiet NaN 0x7e00 with the
// sign kept.
KV_HD uint16_t FloatToHalf(float value) {
  const uint32_t bits = FloatBits(value);
  const uint32_t f = bits & 0x7fffffffu;
  const auto magnitude = static_cast<int32_t>(f);
  // Magnitudes from 65536 on (inf and NaN too) are clamped to 65536, which the rounding below turns into
  // inf (0x7c00); 65520..65535 reach it through the rounding carry.
  const uint32_t n = magnitude < 0x47800000 ? f : 0x47800000u;
  // Normal halves: rebias the exponent and round the 13 dropped bits to nearest even; a carry out of the
  // mantissa correctly bumps the exponent.
  const uint32_t normal = (n + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((n >> 13) & 1u)) >> 13;
  // Below the smallest normal half: adding 0.5f aligns the half subnormal ulp (2^-24) with float's ulp there,
  // so the float addition rounds to nearest even and leaves the half's bits at the bottom.
  const uint32_t subnormal = FloatBits(BitsFloat(f) + BitsFloat(126u << 23)) - (126u << 23);
  const uint32_t quiet_nan = magnitude > 0x7f800000 ? 0x0200u : 0u;  // inf 0x7c00 becomes NaN 0x7e00
  const uint32_t o = magnitude < 0x38800000 ? subnormal : normal | quiet_nan;
  return static_cast<uint16_t>(o | ((bits >> 16) & 0x8000u));
}

// float16 -> float32, exact.
KV_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const auto magnitude = static_cast<int32_t>(h & 0x7fffu);
  // Normal: exponent rebias 15 -> 127; inf and NaN (exponent 0x1f) get 0xff, their payload kept.
  const uint32_t normal =
      (static_cast<uint32_t>(magnitude) << 13) + (112u << 23) + (magnitude >= 0x7c00 ? 112u << 23 : 0u);
  // Zero or subnormal: mantissa * 2^-24, exact in float (converted as a signed int: cheaper to vectorize).
  const uint32_t subnormal = FloatBits(static_cast<float>(magnitude) * BitsFloat(0x33800000u));
  return BitsFloat(sign | (magnitude < 0x400 ? subnormal : normal));
}

// float32 -> bfloat16, round to nearest even; NaN -> quiet NaN with the sign and the payload's top bits kept.
KV_HD uint16_t FloatToBFloat16(float value) {
  const uint32_t u = FloatBits(value);
  const bool nan = static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000;
  // The result is the top half either way: rounded up by the low half, or the NaN with its quiet bit set.
  const uint32_t w = nan ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(w >> 16);
}

KV_HD float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

// Tag types carrying the storage and the float conversions of each T1 / T3.
struct F32 {
  using Storage = float;
  static constexpr Elem kElem = Elem::kFloat32;
  KV_HD static float ToFloat(float v) { return v; }
  KV_HD static float FromFloat(float v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  static constexpr Elem kElem = Elem::kFloat16;
  KV_HD static float ToFloat(uint16_t v) { return HalfToFloat(v); }
  KV_HD static uint16_t FromFloat(float v) { return FloatToHalf(v); }
};
struct BF16 {
  using Storage = uint16_t;
  static constexpr Elem kElem = Elem::kBFloat16;
  KV_HD static float ToFloat(uint16_t v) { return BFloat16ToFloat(v); }
  KV_HD static uint16_t FromFloat(float v) { return FloatToBFloat16(v); }
};

// In the instruction-set builds' namespace where there is one (the attention kernels are compiled generic, AVX2 and
// AVX-512), and always inlined on the host: no build's copy is merged with another's, and no output element pays a
// call.
#if defined(KV_CPU_ISA)
namespace KV_CPU_ISA {
#endif
// An attention output as T1. The exact output is a convex combination of values of T1, so within T1's finite range;
// a finite float32 result past it comes only from rounding (weights rounded to T1 sum to up to 1 + u_T: 65504
// (1 + 2^-11) rounds to inf in float16) and saturates to T1's largest finite value of its sign
// (spec/MultiHeadAttention.md). In float16 and bfloat16 that value's bits are the infinity's less one.
template <class T1>
KV_HD_ALWAYS typename T1::Storage SaturatingFromFloat(float o) {
  typename T1::Storage stored = T1::FromFloat(o);
  if constexpr (T1::kElem != Elem::kFloat32) {
    const float back = T1::ToFloat(stored);
    if (o - o == 0.0f && back - back != 0.0f) --stored;  // o finite, stored +-inf
  }
  return stored;
}
#if defined(KV_CPU_ISA)
}  // namespace KV_CPU_ISA
#endif

// Signed nibbles of one packed int4 byte (ONNX INT4: element 2i low nibble, 2i+1 high nibble).
KV_HD int32_t Int4Low(uint8_t byte) { return static_cast<int32_t>(static_cast<int8_t>(byte << 4)) >> 4; }
KV_HD int32_t Int4High(uint8_t byte) { return static_cast<int32_t>(static_cast<int8_t>(byte)) >> 4; }
KV_HD uint8_t Int4Pack(int32_t low, int32_t high) {
  return static_cast<uint8_t>((low & 0xf) | ((high & 0xf) << 4));
}

}  // namespace kvcache
