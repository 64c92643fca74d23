// Element types of the op and the exact conversions the spec prescribes (float32 <-> float16 /
// bfloat16, round to nearest even). Header-only; usable from host C++ and CUDA device code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD inline
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

// float32 -> float16, round to nearest even, overflow to inf, subnormals kept, NaN -> quiet NaN.
// Branch-light so compilers can vectorize it; relies on IEEE float addition (no -ffast-math, no FTZ).
KV_HD uint16_t FloatToHalf(float value) {
  uint32_t f = FloatBits(value);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t o;
  if (f >= 0x47800000u) {  // >= 65536 (rounds to inf) or inf/NaN
    o = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (f < 0x38800000u) {  // below the smallest normal half: let float addition round
    const float magic = BitsFloat(126u << 23);  // 0.5f: aligns the half subnormal ulp to float's ulp
    o = FloatBits(BitsFloat(f) + magic) - (126u << 23);
  } else {
    const uint32_t mant_odd = (f >> 13) & 1u;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    f += mant_odd;
    o = f >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

// float16 -> float32, exact.
KV_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24, exact in float
  const float magnitude = static_cast<float>(mant) * BitsFloat(0x33800000u);  // 2^-24
  return BitsFloat(sign | FloatBits(magnitude));
}

// float32 -> bfloat16, round to nearest even; NaN -> quiet NaN with the sign kept.
KV_HD uint16_t FloatToBFloat16(float value) {
  const uint32_t u = FloatBits(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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

// Signed nibbles of one packed int4 byte (ONNX INT4: element 2i low nibble, 2i+1 high nibble).
KV_HD int32_t Int4Low(uint8_t byte) { return static_cast<int32_t>(static_cast<int8_t>(byte << 4)) >> 4; }
KV_HD int32_t Int4High(uint8_t byte) { return static_cast<int32_t>(static_cast<int8_t>(byte)) >> 4; }
KV_HD uint8_t Int4Pack(int32_t low, int32_t high) {
  return static_cast<uint8_t>((low & 0xf) | ((high & 0xf) << 4));
}

}  // namespace kvcache
