// The memory-side cost of the CPU op's gathers on one core: the op's traffic with no arithmetic at all.
// Per gathered row of a decode step (H=8, Dh=128, float16 out, num_repeat 1) the op reads the cache row and
// writes the output row with streaming stores: int8 reads 1024 code bytes + 256 scale bytes and writes 2048;
// float16 reads 2048 and writes 2048. This program moves exactly those bytes per row (no page table) and
// compares "bytes moved per second" with a plain memcpy of half as many bytes, as the benchmark does. It walks
// the rows as one sequential stream and as four streams side by side, a head row from each in turn: the
// order decides how many reads one core keeps in flight.
//
//   g++ -O2 -mavx512f traffic_bound.cc -o traffic_bound && ./traffic_bound
//   g++ -O2 -mavx2 traffic_bound.cc -o traffic_bound && ./traffic_bound   (no AVX-512: "64-byte" stores are two
//   32-byte ones)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Reads `in_bytes` and streams `out_bytes` per row, with 32- or 64-byte streaming stores; returns bytes moved
// per second. The rows are walked as `kStreams` streams side by side (stream j: rows j * rows / kStreams on),
// an eighth of a row (one head row of H = 8) from each stream in turn; one stream is the plain sequential walk.
template <int kStore, int kStreams>
double Pattern(const char* in, char* out, size_t rows, size_t in_bytes, size_t out_bytes, int* sink) {
  const double start = Now();
  __m256i acc = _mm256_setzero_si256();
  const size_t per = rows / kStreams, in_head = in_bytes / 8, out_head = out_bytes / 8;
  for (size_t r = 0; r < per; ++r) {
    for (size_t h = 0; h < 8; ++h) {
      for (int j = 0; j < kStreams; ++j) {
        const char* s = in + (j * per + r) * in_bytes + h * in_head;
        char* d = out + (j * per + r) * out_bytes + h * out_head;
        for (size_t i = 0; i < in_head; i += 32) acc = _mm256_add_epi32(acc, _mm256_load_si256((const __m256i*)(s + i)));
#ifdef __AVX512F__
        if constexpr (kStore == 64) {
          const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(acc), acc, 1);
          for (size_t i = 0; i < out_head; i += 64) _mm512_stream_si512((__m512i*)(d + i), v);
          continue;
        }
#endif
        for (size_t i = 0; i < out_head; i += 32) _mm256_stream_si256((__m256i*)(d + i), acc);
      }
    }
  }
  _mm_sfence();
  *sink += _mm256_extract_epi32(acc, 0);
  return double(per * kStreams) * double(in_bytes + out_bytes) / (Now() - start);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  const size_t rows = 128 * 1024, most = 2048;  // 256 MiB of output: far beyond the caches
  char* in = static_cast<char*>(std::aligned_alloc(64, rows * most));
  char* out = static_cast<char*>(std::aligned_alloc(64, rows * most));
  std::memset(in, 1, rows * most);
  std::memset(out, 2, rows * most);
  int sink = 0;
  struct Case { const char* name; size_t in, out; } cases[] = {{"int8 gather", 1280, 2048}, {"float16 gather", 2048, 2048}};
  std::printf("median of 7 rounds, GB/s of bytes read + written; ratio = pattern / memcpy of the same bytes moved\n");
  for (const Case& c : cases) {
    std::vector<double> copy, s32, s64, side;
    for (int round = 0; round < 7; ++round) {
      const size_t half = rows * (c.in + c.out) / 2;
      const double start = Now();
      std::memcpy(out, in, half);
      copy.push_back(2.0 * double(half) / (Now() - start));
      s32.push_back(Pattern<32, 1>(in, out, rows, c.in, c.out, &sink));
      s64.push_back(Pattern<64, 1>(in, out, rows, c.in, c.out, &sink));
      side.push_back(Pattern<64, 4>(in, out, rows, c.in, c.out, &sink));
    }
    const double m = Median(copy), a = Median(s32), b = Median(s64), f = Median(side);
    std::printf("%-15s memcpy %6.2f | one stream: 32-byte streaming stores %6.2f (%.2fx), 64-byte %6.2f (%.2fx) | "
                "four streams side by side, 64-byte %6.2f (%.2fx)\n",
                c.name, m / 1e9, a / 1e9, a / m, b / 1e9, b / m, f / 1e9, f / m);
  }
  return sink == 42 ? 1 : 0;
}
