// Streaming stores of short rows that come as several interleaved streams, each stream's rows one after another
// in memory, written as whole 64-byte lines.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_cpu_rows.h"

namespace kvcache {
namespace KV_CPU_ISA {

// Layout 3's scale rows are such streams: a token's 2H scale rows (one per head of key and of value) lie MaxT rows
// apart, and the next token's rows continue each of them. A row of 16 float16 scales is half a line. Written with
// ordinary stores, each half line is read into the cache first, and in this pattern (the 2H lines a power-of-two
// distance apart where MaxT is a power of two: the same sets of the core's caches) that doubled the stores'
// traffic time and took about a quarter of an int8 prefill in layout 3; gathering a page's scale rows to copy each
// head's at once did not help (benchmarks/cpu/bound/scale_rows.cc and its README). Here each stream
// keeps its one part-written line until its next row completes it, then streams it whole from a register, so no
// scale line is read. Rows that do not fill a whole line or one of its halves are written with ordinary stores; a
// line still part written at Flush (its other half another task's, or not stored in this call) is written with
// a masked store of this writer's bytes only. Streaming stores want a fence before other threads read the lines.
class InterleavedStreams {
 public:
  // Room for streams 0 .. streams - 1.
  explicit InterleavedStreams(int64_t streams) : held_(KV_AVX512 ? static_cast<size_t>(streams) : 0) {}
  InterleavedStreams(const InterleavedStreams&) = delete;
  InterleavedStreams& operator=(const InterleavedStreams&) = delete;
  ~InterleavedStreams() { Flush(); }

#if KV_AVX512
  // The first `bytes` (32 or 64) bytes of v to dst, the next row of stream q: a whole line streamed at once, a
  // half line held until the stream's next row completes it (a stream's held line written first when the row
  // starts another), anything else written with ordinary stores.
  KV_ALWAYS_INLINE void Write(int64_t q, void* dst, __m512i v, int bytes) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(dst), offset = at % 64;
    if (bytes == 64 && offset == 0) {
      _mm512_stream_si512(static_cast<__m512i*>(dst), v);
      return;
    }
    if (bytes != 32 || offset % 32 != 0) {
      _mm512_mask_storeu_epi8(dst, bytes >= 64 ? ~uint64_t{0} : (uint64_t{1} << bytes) - 1, v);
      return;
    }
    Held& held = held_[static_cast<size_t>(q)];
    const uintptr_t line = at - offset;
    if (held.filled != 0 && held.line != line) WritePart(held);
    held.line = line;
    const uint64_t bits = offset == 0 ? 0xffffffffull : 0xffffffff00000000ull;
    const __m512i placed = offset == 0 ? v : _mm512_inserti64x4(v, _mm512_castsi512_si256(v), 1);
    if (MergeHeldLine(held.data, held.filled, reinterpret_cast<void*>(line), placed, bits)) held.filled = 0;
  }
#endif

  // Writes each line still held part written (this writer's bytes of it). Call before the task ends.
  void Flush() {
#if KV_AVX512
    for (Held& held : held_)
      if (held.filled != 0) WritePart(held);
#endif
  }

 private:
  struct alignas(64) Held {
    unsigned char data[64] = {};  // the held line's bytes so far
    uintptr_t line = 0;           // the line held, where `filled` is not 0
    uint64_t filled = 0;          // which of its bytes this writer wrote
  };

#if KV_AVX512
  static void WritePart(Held& held) {
    _mm512_mask_storeu_epi8(reinterpret_cast<void*>(held.line), held.filled, _mm512_load_si512(held.data));
    held.filled = 0;
  }
#endif

  std::vector<Held> held_;
};

}  // namespace KV_CPU_ISA
}  // namespace kvcache
