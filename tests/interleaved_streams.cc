// Test entry points of cpu/kv_interleaved_streams.h, built once per instruction set (KV_CPU_ISA and its -m flags):
// rows of a buffer written through InterleavedStreams in a given order, each the next row of a given stream, by
// one task or by two threads each with its own writer, as the stores' tasks do.
#include <cstdint>
#include <thread>

#include "kv_interleaved_streams.h"

namespace {

using kvcache::KV_CPU_ISA::InterleavedStreams;

// Rows r = first, first + step, ... of (streams, offsets, sizes): src's bytes at each offset into out at the same
// offset, as the next row of stream streams[r] (of `count`). 0 on success, -2 where this build has no Write.
int WriteRows(unsigned char* out, const unsigned char* src, const int64_t* streams, const int64_t* offsets,
              const int64_t* sizes, int64_t rows, int64_t count, int64_t first, int64_t step) {
#if KV_AVX512
  InterleavedStreams writer(count);
  for (int64_t r = first; r < rows; r += step) {
    const uint64_t bits = sizes[r] >= 64 ? ~uint64_t{0} : (uint64_t{1} << sizes[r]) - 1;
    writer.Write(streams[r], out + offsets[r], _mm512_maskz_loadu_epi8(bits, src + offsets[r]),
                 static_cast<int>(sizes[r]));
  }
  writer.Flush();
  kvcache::KV_CPU_ISA::StoreFence();
  return 0;
#else
  (void)out, (void)src, (void)streams, (void)offsets, (void)sizes, (void)rows, (void)count, (void)first, (void)step;
  InterleavedStreams writer(count);  // built and flushed empty: harmless where this build has no Write
  writer.Flush();
  return -2;
#endif
}

}  // namespace

// The rows in order, by one task. 0 on success.
extern "C" int interleaved_streams_write(unsigned char* out, const unsigned char* src, const int64_t* streams,
                                         const int64_t* offsets, const int64_t* sizes, int64_t rows, int64_t count) {
  return WriteRows(out, src, streams, offsets, sizes, rows, count, 0, 1);
}

// The even rows by one thread and the odd rows by another at the same time, each with its own writer.
extern "C" int interleaved_streams_write_two_threads(unsigned char* out, const unsigned char* src,
                                                     const int64_t* streams, const int64_t* offsets,
                                                     const int64_t* sizes, int64_t rows, int64_t count) {
  int other = 0;
  std::thread odd([&] { other = WriteRows(out, src, streams, offsets, sizes, rows, count, 1, 2); });
  const int even = WriteRows(out, src, streams, offsets, sizes, rows, count, 0, 2);
  odd.join();
  return even != 0 ? even : other;
}
