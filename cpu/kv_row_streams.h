// Rows copied into a streamed output as several sequential source streams read side by side.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kv_line_streams.h"

namespace kvcache {
namespace KV_CPU_ISA {

// At most this many runs side by side (WriteRowsSideBySide).
constexpr int64_t kMaxRowStreams = 16;

// One row of WriteRowsSideBySide: `bytes` bytes from src to dst. lead and tail_follows as WriteRows': lead (not
// null) the 64 bytes before dst in the output, of a row the same call writes with tail_follows; tail_follows, the
// row after dst in the output is one the same call writes, led.
struct StreamedRow {
  const void* src;
  void* dst;
  const void* lead;
  bool tail_follows;
};

#if KV_AVX512
// A row of whole 64-byte vectors off a line (row.dst at an even byte `offset` of its first line) touches
// bytes / 64 + 1 output lines: line m holds the row's bytes from 64 m - offset, cut in registers (one permute) from
// the row's vectors m - 1 and m (the first line's vector before: row.lead, the row before's last bytes). The first
// line, led, is streamed whole, else its part held in `lines`; the last (m = bytes / 64) ends with the row after's
// first bytes: left to that row where tail_follows, else its part held. Every load lies inside the row or its lead.
// (Unaligned loads of each line's bytes instead, as a memcpy does, measured 0.88-0.96x a copy with 8 runs side by
// side and 0.65-0.71x with 16, against 1.08x and 1.04x cut in registers, in separate runs on an Intel Xeon of
// family 6 model 167, one core, float16 decode 16 bytes past a line.)
class OffsetRow {
 public:
  explicit OffsetRow(const StreamedRow& row)
      : src_(static_cast<const unsigned char*>(row.src)),
        first_line_(static_cast<unsigned char*>(row.dst) - reinterpret_cast<uintptr_t>(row.dst) % 64),
        offset_(static_cast<int>(reinterpret_cast<uintptr_t>(row.dst) % 64)),
        cut_(offset_) {}

  // Lines c / 64 .. (c + n) / 64 of the row (c and n multiples of 64, n > 0). The line held in `lines` (the first of
  // a row not led) is put before the loop, and the permute chosen before it (LineCut::Visit): the loop only streams.
  // With the hold tested in the loop (its MergeLine call inside), rows 16 bytes past a line ran slower than on lines
  // (measured on an Intel Xeon of family 6 model 167, one core, benchmarks/cpu/bound/token_runs.cc, five runs each,
  // the kernel's writer 16 bytes past a line: 8 heads of 128 0.98-1.11x a copy so, 1.07-1.14x now; 32 heads
  // 0.99-1.13x, 1.11-1.24x; on lines 1.10-1.24x either way).
  KV_ALWAYS_INLINE void Put(LineStreams& lines, const StreamedRow& row, size_t c, size_t n) const {
    cut_.Visit([&](auto cut) __attribute__((always_inline)) {
      size_t k = c;
      __m512i before;
      if (c > 0) {
        before = _mm512_loadu_si512(src_ + c - 64);
      } else if (row.lead != nullptr) {
        before = _mm512_loadu_si512(row.lead);
      } else {  // the row's first line, shared with a row this call does not write: held
        before = _mm512_loadu_si512(src_);
        lines.MergeLine(first_line_, cut(_mm512_setzero_si512(), before), ~uint64_t{0} << offset_);
        k = 64;
      }
      for (; k < c + n; k += 64) {
        const __m512i v = _mm512_loadu_si512(src_ + k);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(first_line_ + k), cut(before, v));
        before = v;
      }
    });
  }

  // The row's last line (after its last Put), unless the row after writes it.
  KV_ALWAYS_INLINE void End(LineStreams& lines, const StreamedRow& row, size_t bytes) const {
    if (row.tail_follows) return;
    const __m512i last = cut_(_mm512_loadu_si512(src_ + bytes - 64), _mm512_setzero_si512());
    lines.MergeLine(first_line_ + bytes, last, (uint64_t{1} << offset_) - 1);
  }

 private:
  const unsigned char* src_;
  unsigned char* first_line_;
  int offset_;
  LineCut cut_;
};
#endif

// Whether WriteRowsSideBySide takes rows of `bytes` bytes into outputs starting at these addresses: AVX-512, rows
// of whole vectors, even addresses (every row of an output then shares its start's offset from a line). Elsewhere
// the gathers write a row at a time as before: rows of part vectors or at odd addresses would be cut at every
// chunk, each cut two more lines held part written.
inline bool RowsGoSideBySide(const void* key_out, const void* value_out, size_t bytes) {
  return KV_AVX512 && bytes % 64 == 0 && reinterpret_cast<uintptr_t>(key_out) % 2 == 0 &&
         reinterpret_cast<uintptr_t>(value_out) % 2 == 0;
}

#if KV_AVX512
// rows[0, count), `bytes` bytes each (RowsGoSideBySide), written as `streams` (1 to kMaxRowStreams) runs of
// consecutive rows read side by side: `chunk` bytes of the current row of each run in turn. One core keeps more
// reads in flight down several sequential streams than down one, as the hardware prefetchers run ahead on each
// stream they track (glibc's large memcpy interleaves four pages for the same reason). A run is many rows long:
// runs of a few rows restart the prefetchers at every turn. The bytes written are the same whatever the streams or
// chunk. Lines a row writes whole are streamed; a row off a line is cut in registers and chained to its led
// neighbours (OffsetRow), and the edge lines it shares with rows this call does not write are held in `lines`.
inline void WriteRowsSideBySide(LineStreams& lines, const StreamedRow* rows, int64_t count, size_t bytes,
                                int64_t streams, size_t chunk) {
  if (count <= 0) return;
  const int64_t runs = std::clamp<int64_t>(streams, 1, std::min(count, kMaxRowStreams));
  const int64_t len = (count + runs - 1) / runs;  // run j: rows j * len .. min(count, (j + 1) * len)
  chunk = std::max<size_t>(64, chunk / 64 * 64);
  for (int64_t r = 0; r < len; ++r) {
    const int64_t live = (count - r + len - 1) / len;  // the runs that have a row r: j * len + r < count
    for (size_t c = 0; c < bytes; c += chunk) {
      const size_t n = std::min(chunk, bytes - c);
      for (int64_t j = 0; j < live; ++j) {
        const StreamedRow& row = rows[j * len + r];
        if (OnCacheLine(row.dst)) {
          const auto* s = static_cast<const unsigned char*>(row.src) + c;
          auto* d = static_cast<unsigned char*>(row.dst) + c;
          for (size_t k = 0; k < n; k += 64)
            _mm512_stream_si512(reinterpret_cast<__m512i*>(d + k), _mm512_loadu_si512(s + k));
        } else {
          OffsetRow(row).Put(lines, row, c, n);
        }
      }
    }
    for (int64_t j = 0; j < live; ++j) {  // the last lines of rows off a line
      const StreamedRow& row = rows[j * len + r];
      if (!OnCacheLine(row.dst)) OffsetRow(row).End(lines, row, bytes);
    }
  }
}
#endif

}  // namespace KV_CPU_ISA
}  // namespace kvcache
