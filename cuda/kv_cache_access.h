// How a KeyValueCache CUDA thread touches memory: the slot cursor over a sequence's page table, code storage
// per quant_bit, and 16-byte loads and stores of eight elements (or codes), all through the memory policy
// `Mem` (kv_cache_work.h says what it is), so the host runner sees every byte.
#pragma once

#include <cstdint>

#include "kv_cache_launch.h"
#include "kv_types.h"

namespace kvcache {
namespace cuda {

// Slots of positions first, first + step, first + 2 * step, ... of sequence b. Positions are unsigned:
// start_pos[b] + i may exceed INT64_MAX; the page index and the slot fit (validated on the host). One
// division for the first position; a page entry is read only when a position on that page is asked for,
// so the cursor never reads past the sequence's validated pages.
template <class Mem>
struct SlotCursor {
  Mem& mem;
  int64_t entry, base, offset, step, page_size;  // page_size 0: offset mode, one run
  bool stale;                                    // entry moved on: base is read at the next position

  KV_HD SlotCursor(const Params& p, Mem& m, int64_t b, uint64_t first, int64_t step_)
      : mem(m), entry(b), offset(0), step(step_), page_size(0), stale(false) {
    if (p.cache_mode == 1) {
      const uint64_t size = static_cast<uint64_t>(p.page_size);
      page_size = p.page_size;
      entry = b * p.max_p + static_cast<int64_t>(first / size);
      offset = static_cast<int64_t>(first % size);
    }
    base = mem.template Load<int64_t>(kCachestarts, 8 * entry) + (page_size ? 0 : static_cast<int64_t>(first));
  }
  // The slot of the next position.
  KV_HD int64_t Next() {
    while (page_size && offset >= page_size) {
      offset -= page_size;
      ++entry;
      stale = true;
    }
    if (stale) {
      base = mem.template Load<int64_t>(kCachestarts, 8 * entry);
      stale = false;
    }
    const int64_t slot = base + offset;
    offset += step;
    return slot;
  }
};

template <class Mem>
KV_HD int64_t IndexAt(Mem& mem, Buf buf, int64_t i) {
  return mem.template Load<int64_t>(buf, 8 * i);
}

// Code storage per quant_bit: code `elem` of the cache (element offset) is read and written here.
template <int QBits>
struct Codes;
template <>
struct Codes<8> {
  static constexpr float kMax = 127.0f;
  // `buf`: the buffer holding the codes (the attention kernels name their own cache buffer).
  template <class Mem, class B = Buf>
  KV_HD static int32_t Get(Mem& mem, int64_t elem, B buf = kCache) {
    return mem.template Load<int8_t>(buf, elem);
  }
  // Writes the code(s) of elements elem (and elem + 1 when `pair`).
  template <class Mem>
  KV_HD static void Put(Mem& mem, int64_t elem, int32_t first, int32_t second, bool pair) {
    mem.template Store<int8_t>(kCache, elem, static_cast<int8_t>(first));
    if (pair) mem.template Store<int8_t>(kCache, elem + 1, static_cast<int8_t>(second));
  }
};
template <>
struct Codes<4> {
  static constexpr float kMax = 7.0f;
  template <class Mem, class B = Buf>
  KV_HD static int32_t Get(Mem& mem, int64_t elem, B buf = kCache) {
    const uint8_t byte = mem.template Load<uint8_t>(buf, elem / 2);
    return (elem & 1) ? Int4High(byte) : Int4Low(byte);
  }
  // elem is even and a pair is always written: one whole byte.
  template <class Mem>
  KV_HD static void Put(Mem& mem, int64_t elem, int32_t first, int32_t second, bool) {
    mem.template Store<uint8_t>(kCache, elem / 2, Int4Pack(first, second));
  }
};

// Copies n elements of T from (src_buf, src byte offset) to (dst_buf, dst byte offset): 16 bytes per
// access when n is kVec elements of a 2- or 4-byte type (offsets are then 16-byte multiples).
template <class T, class Mem>
KV_HD void CopyUnit(Mem& mem, Buf src_buf, int64_t src, Buf dst_buf, int64_t dst, int64_t n) {
  if (n == kVec && (kVec * sizeof(T)) % 16 == 0) {
    for (int64_t k = 0; k < int64_t(kVec * sizeof(T) / 16); ++k)
      mem.template Store<Vec16>(dst_buf, dst + 16 * k, mem.template Load<Vec16>(src_buf, src + 16 * k));
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    mem.template Store<T>(dst_buf, dst + i * int64_t(sizeof(T)), mem.template Load<T>(src_buf, src + i * int64_t(sizeof(T))));
}

// Eight T1 elements at a 16-byte aligned byte offset, as floats: one or two 16-byte loads.
template <class T1, class Mem>
KV_HD void LoadEight(Mem& mem, Buf buf, int64_t offset, float (&v)[kVec]) {
  using T = typename T1::Storage;
  for (int k = 0; k < int(kVec * sizeof(T) / 16); ++k) {
    const Vec16 w = mem.template Load<Vec16>(buf, offset + 16 * k);
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 2) {
        v[8 * k + 2 * i] = T1::ToFloat(static_cast<uint16_t>(w.w[i] & 0xffffu));
        v[8 * k + 2 * i + 1] = T1::ToFloat(static_cast<uint16_t>(w.w[i] >> 16));
      } else {
        v[4 * k + i] = T1::ToFloat(BitsFloat(w.w[i]));
      }
    }
  }
}

// Two floats rounded to T1's 16-bit storage by the portable conversions and packed, the first in the low half.
template <class T1>
KV_HD uint32_t PackTwo(float lo, float hi) {
  return uint32_t(T1::FromFloat(lo)) | (uint32_t(T1::FromFloat(hi)) << 16);
}

// Two floats that are not NaN rounded to nearest even to T1's 16-bit storage and packed, the first in the
// low half. On sm_80 and newer GPUs this is one cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32 (older GPUs and the
// host use the portable conversions): it rounds every input that is not NaN exactly as the portable
// conversions do (IEEE round to nearest even, overflow to inf, subnormals kept), but would not keep a
// NaN's sign and payload as the spec's conversions do.
template <class T1>
KV_HD uint32_t PackTwoNotNaN(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // the packed conversions are sm_80's
  uint32_t packed;
  if constexpr (T1::kElem == Elem::kFloat16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
  } else if constexpr (T1::kElem == Elem::kBFloat16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
  }
#endif
  return PackTwo<T1>(lo, hi);
}

// Eight floats rounded to T1 and written at a 16-byte aligned byte offset: one or two 16-byte stores.
// NotNaN: the caller knows no value is NaN (the GPU then converts two values per instruction).
template <class T1, bool NotNaN = false, class Mem>
KV_HD void StoreEight(Mem& mem, Buf buf, int64_t offset, const float (&v)[kVec]) {
  using T = typename T1::Storage;
  for (int k = 0; k < int(kVec * sizeof(T) / 16); ++k) {
    Vec16 w;
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 2) {
        const float lo = v[8 * k + 2 * i], hi = v[8 * k + 2 * i + 1];
        w.w[i] = NotNaN ? PackTwoNotNaN<T1>(lo, hi) : PackTwo<T1>(lo, hi);
      } else {
        w.w[i] = FloatBits(T1::FromFloat(v[4 * k + i]));
      }
    }
    mem.template Store<Vec16>(buf, offset + 16 * k, w);
  }
}

KV_HD bool IsFinite(float x) { return (FloatBits(x) & 0x7f800000u) != 0x7f800000u; }

// The eight codes starting at cache element `elem` (a multiple of 8) as one word: one 8-byte load of int8
// codes, one 4-byte load of packed int4 pairs.
template <int QBits, class Mem, class B = Buf>
KV_HD uint64_t LoadEightCodes(Mem& mem, int64_t elem, B buf = kCache) {
  if constexpr (QBits == 8) return mem.template Load<uint64_t>(buf, elem);
  return mem.template Load<uint32_t>(buf, elem / 2);
}

// The eight signed codes of a word from LoadEightCodes, in element order.
template <int QBits>
KV_HD void UnpackEightCodes(uint64_t w, int32_t (&code)[kVec]) {
  for (int e = 0; e < kVec; ++e) {
    if constexpr (QBits == 8) {
      code[e] = static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * e)));
    } else {
      const uint8_t byte = static_cast<uint8_t>(w >> (4 * (e & ~1)));
      code[e] = (e & 1) ? Int4High(byte) : Int4Low(byte);
    }
  }
}

// Writes eight codes at cache element `elem` (a multiple of 8): one 8-byte or one 4-byte store.
template <int QBits, class Mem>
KV_HD void StoreEightCodes(Mem& mem, int64_t elem, const int32_t (&code)[kVec]) {
  if constexpr (QBits == 8) {
    uint64_t w = 0;
    for (int e = 0; e < kVec; ++e) w |= uint64_t(static_cast<uint8_t>(code[e])) << (8 * e);
    mem.template Store<uint64_t>(kCache, elem, w);
  } else {
    uint32_t w = 0;
    for (int e = 0; e < kVec; e += 2) w |= uint32_t(Int4Pack(code[e], code[e + 1])) << (4 * e);
    mem.template Store<uint32_t>(kCache, elem / 2, w);
  }
}

}  // namespace cuda
}  // namespace kvcache
