// Test entry points of cpu/kv_line_streams.h and cpu/kv_row_streams.h, built once per instruction set (KV_CPU_ISA
// and its -m flags): rows of an output written through LineStreams (or, in the AVX-512 build, ShiftedRow, or as
// runs side by side, WriteRowsSideBySide) in a given order, by one task or by two threads each with its own
// LineStreams, as the gathers' tasks do.
#include <cstdint>
#include <thread>
#include <vector>

#include "kv_line_streams.h"
#include "kv_row_streams.h"

namespace {

using kvcache::KV_CPU_ISA::LineStreams;

// Rows r = first, first + step, ... of (offsets, sizes): src's bytes at each offset into out at the same offset.
int WriteRows(unsigned char* out, const unsigned char* src, const int64_t* offsets, const int64_t* sizes,
              int64_t rows, int shifted, int64_t first, int64_t step) {
  LineStreams lines;
  for (int64_t r = first; r < rows; r += step) {
    if (shifted) {
#if KV_AVX512
      if (sizes[r] % 64 != 0 || reinterpret_cast<uintptr_t>(out + offsets[r]) % 2 != 0) return -1;
      kvcache::KV_CPU_ISA::ShiftedRow row(lines, out + offsets[r]);
      __m512i previous = _mm512_setzero_si512();
      for (int64_t k = 0; k < sizes[r]; k += 64) row.Put(_mm512_loadu_si512(src + offsets[r] + k), previous);
      row.End(previous);
#else
      return -2;
#endif
    } else {
      lines.Write(out + offsets[r], src + offsets[r], static_cast<size_t>(sizes[r]));
    }
  }
  lines.Flush();
  kvcache::KV_CPU_ISA::StoreFence();
  return 0;
}

}  // namespace

// Whether this build has ShiftedRow (AVX-512).
extern "C" int line_streams_shifted() { return KV_AVX512; }

// The rows in order, by one task. shifted: through ShiftedRow (sizes whole vectors, offsets even). 0 on success.
extern "C" int line_streams_write(unsigned char* out, const unsigned char* src, const int64_t* offsets,
                                  const int64_t* sizes, int64_t rows, int shifted) {
  return WriteRows(out, src, offsets, sizes, rows, shifted, 0, 1);
}

// The even rows through one writer and the odd rows through another, both alive in this thread at once (the
// second cannot borrow the thread's table and takes its own), written in turn.
extern "C" int line_streams_write_nested(unsigned char* out, const unsigned char* src, const int64_t* offsets,
                                         const int64_t* sizes, int64_t rows, int shifted) {
  if (shifted) return -3;
  LineStreams even, odd;
  for (int64_t r = 0; r < rows; ++r)
    (r % 2 == 0 ? even : odd).Write(out + offsets[r], src + offsets[r], static_cast<size_t>(sizes[r]));
  odd.Flush();
  even.Flush();
  kvcache::KV_CPU_ISA::StoreFence();
  return 0;
}

// The even rows by one thread and the odd rows by another at the same time, each with its own LineStreams.
extern "C" int line_streams_write_two_threads(unsigned char* out, const unsigned char* src, const int64_t* offsets,
                                              const int64_t* sizes, int64_t rows, int shifted) {
  int other = 0;
  std::thread odd([&] { other = WriteRows(out, src, offsets, sizes, rows, shifted, 1, 2); });
  const int even = WriteRows(out, src, offsets, sizes, rows, shifted, 0, 2);
  odd.join();
  return even != 0 ? even : other;
}

namespace {

// Rows first .. last - 1 at (offsets), `bytes` each, as one task's list for WriteRowsSideBySide: src's bytes at
// each offset into out at the same offset, a row led by the row before (its last 64 source bytes) where that row
// is in the list and ends where this one starts, as the gathers lead a token's rows. 0 on success.
int SideBySide(unsigned char* out, const unsigned char* src, const int64_t* offsets, int64_t first, int64_t last,
               int64_t bytes, int64_t streams, int64_t chunk) {
#if KV_AVX512
  using kvcache::KV_CPU_ISA::StreamedRow;
  std::vector<StreamedRow> rows;
  for (int64_t r = first; r < last; ++r) {
    if (!kvcache::KV_CPU_ISA::RowsGoSideBySide(out + offsets[r], out + offsets[r], static_cast<size_t>(bytes)))
      return -1;
    const bool led = r > first && offsets[r - 1] + bytes == offsets[r];
    const bool followed = r + 1 < last && offsets[r] + bytes == offsets[r + 1];
    rows.push_back({src + offsets[r], out + offsets[r], led ? src + offsets[r] - 64 : nullptr, followed});
  }
  LineStreams lines;
  kvcache::KV_CPU_ISA::WriteRowsSideBySide(lines, rows.data(), static_cast<int64_t>(rows.size()),
                                           static_cast<size_t>(bytes), streams, static_cast<size_t>(chunk));
  lines.Flush();
  kvcache::KV_CPU_ISA::StoreFence();
  return 0;
#else
  (void)out, (void)src, (void)offsets, (void)first, (void)last, (void)bytes, (void)streams, (void)chunk;
  return -2;
#endif
}

}  // namespace

// The rows (offsets ascending, `bytes` each) as `streams` runs side by side, `chunk` bytes of each run's row in
// turn; threads=2: the first half by one thread and the second by another at the same time, each its own list
// (their meeting rows not led). 0 on success; -1 where the rows are not whole vectors at even addresses, -2 in
// a build without AVX-512.
extern "C" int line_streams_side_by_side(unsigned char* out, const unsigned char* src, const int64_t* offsets,
                                         int64_t rows, int64_t bytes, int64_t streams, int64_t chunk, int threads) {
  if (threads == 1) return SideBySide(out, src, offsets, 0, rows, bytes, streams, chunk);
  int other = 0;
  std::thread second([&] { other = SideBySide(out, src, offsets, rows / 2, rows, bytes, streams, chunk); });
  const int first = SideBySide(out, src, offsets, 0, rows / 2, bytes, streams, chunk);
  second.join();
  return first != 0 ? first : other;
}
