// How the CPU kernel addresses a row of quantized codes in the cache: int8 codes one per byte, int4 codes two
// per byte (ONNX INT4 packing: element 2i in the low nibble of byte i, 2i+1 in the high nibble).
#pragma once

#include <cstdint>

#include "kv_types.h"

namespace kvcache {
namespace KV_CPU_ISA {

template <int QBits>
struct Codes;

template <>
struct Codes<8> {
  using Storage = int8_t;
  static constexpr float kMax = 127.0f;
  static int8_t* Row(void* cache, int64_t elem) { return static_cast<int8_t*>(cache) + elem; }
  static const int8_t* Row(const void* cache, int64_t elem) { return static_cast<const int8_t*>(cache) + elem; }
};

template <>
struct Codes<4> {
  using Storage = uint8_t;
  static constexpr float kMax = 7.0f;
  // Dh is even, so a row starts on a byte.
  static uint8_t* Row(void* cache, int64_t elem) { return static_cast<uint8_t*>(cache) + elem / 2; }
  static const uint8_t* Row(const void* cache, int64_t elem) { return static_cast<const uint8_t*>(cache) + elem / 2; }
};

constexpr int64_t CodeBytes8(int qbits) { return qbits == 8 ? 8 : 4; }  // bytes of 8 codes

}  // namespace KV_CPU_ISA
}  // namespace kvcache
