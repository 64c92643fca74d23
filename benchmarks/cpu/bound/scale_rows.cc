// What an int8 prefill's scale rows cost to store, layout 0 against layout 3, on one core: the memory traffic of
// the op's stores with no arithmetic. The benchmark's prefill (B=4 x 512 tokens, H=8, Dh=128, float16 in, groups
// of 8, float16 scales, pages of 64 slots in a shuffled page table, MaxT 2048) reads each token's key and value
// (4 KiB), writes its output rows (4 KiB, ordinary stores: the outputs stay cached), streams its 2 KiB of codes
// and writes its 512 bytes of scales. In layout 0 a token's rows lie together; in layout 3 its 16 code rows lie
// 256 KiB apart and its 16 scale rows (32 bytes: half a line each) 64 KiB apart, each continued by the next
// token's. Against layout 0 with ordinary scale stores, layout 3's scale rows are written four ways: ordinary
// stores (what the op did), not at all (the bound), a page's scale rows gathered in a buffer and copied a head at a
// time, and each row's half line held until the next token's row completes it, then streamed whole. (The kernel's
// InterleavedStreams, cpu/, merges the halves in a 64-byte register and streams the line in one store; this
// AVX2 program keeps the first half in memory and streams the two halves back to back, the same traffic.) Rounds
// interleave the patterns, each after 32 MiB of other writes, medians of the last 3 of 5 calls a round.
//
//   g++ -O2 -mavx2 scale_rows.cc -o scale_rows && ./scale_rows [rounds]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kTokens = 2048, kHeads = 8, kPage = 64, kRows = 2 * kHeads;  // a token's head rows, key and value
constexpr size_t kSourceBytes = 4096, kCodeBytes = 128, kScaleBytes = 32;  // a token's source; a head row's

enum Pattern { kLayout0, kPlain, kNone, kCopied, kStreamed, kPatterns };
const char* const kNames[kPatterns] = {
    "layout 0 (a token's rows together), ordinary scale stores",
    "layout 3, scale rows with ordinary stores",
    "layout 3, no scale rows written",
    "layout 3, a page's scale rows copied a head at a time",
    "layout 3, scale lines held, streamed whole",
};

struct Buffers {
  char *source, *output, *codes, *scales;
  std::vector<int> page_of;  // the page table: token t's slot is page_of[t / kPage] * kPage + t % kPage
};

char* Allocate(size_t bytes, int fill) {
  auto* p = static_cast<char*>(std::aligned_alloc(64, bytes));
  if (p == nullptr) std::exit(1);
  std::memset(p, fill, bytes);
  return p;
}

void Stream64(char* dst, __m256i v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), v);
}

// One call's stores in `pattern`; returns milliseconds.
double Run(const Buffers& b, Pattern pattern) {
  alignas(64) static char page_scales[kRows][kPage * kScaleBytes];  // kCopied: a page's scale rows, head by head
  alignas(64) static char held[kRows][32];                           // kStreamed: each stream's first half line
  const auto start = std::chrono::steady_clock::now();
  for (int t0 = 0; t0 < kTokens; t0 += kPage) {
    const int base = b.page_of[t0 / kPage] * kPage;
    for (int i = 0; i < kPage; ++i) {
      const int t = t0 + i, slot = base + i;
      const char* src = b.source + static_cast<size_t>(t) * kSourceBytes;
      char* out = b.output + static_cast<size_t>(t) * kSourceBytes;
      __m256i acc = _mm256_setzero_si256();  // stands for the codes and scales computed from the source
      for (size_t k = 0; k < kSourceBytes; k += 32) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(src + k));
        acc = _mm256_add_epi32(acc, v);
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + k), v);
      }
      for (int r = 0; r < kRows; ++r) {
        const bool together = pattern == kLayout0;
        char* code = b.codes + (together ? static_cast<size_t>(slot) * kRows + r
                                         : static_cast<size_t>(r) * kTokens + slot) * kCodeBytes;
        char* scale = b.scales + (together ? static_cast<size_t>(slot) * kRows + r
                                           : static_cast<size_t>(r) * kTokens + slot) * kScaleBytes;
        Stream64(code, acc), Stream64(code + 64, acc);
        switch (pattern) {
          case kLayout0:
          case kPlain:
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(scale), acc);
            break;
          case kCopied:
            _mm256_store_si256(reinterpret_cast<__m256i*>(page_scales[r] + i * kScaleBytes), acc);
            break;
          case kStreamed:  // slots of a page start even: a line's first half, then the next token's second
            if (slot % 2 == 0) {
              _mm256_store_si256(reinterpret_cast<__m256i*>(held[r]), acc);
            } else {
              _mm256_stream_si256(reinterpret_cast<__m256i*>(scale - 32),
                                  _mm256_load_si256(reinterpret_cast<const __m256i*>(held[r])));
              _mm256_stream_si256(reinterpret_cast<__m256i*>(scale), acc);
            }
            break;
          default:
            break;
        }
      }
    }
    if (pattern == kCopied)
      for (int r = 0; r < kRows; ++r)
        std::memcpy(b.scales + (static_cast<size_t>(r) * kTokens + base) * kScaleBytes, page_scales[r],
                    sizeof page_scales[r]);
  }
  _mm_sfence();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  char* end = nullptr;
  const long rounds = argc > 1 ? std::strtol(argv[1], &end, 10) : 41;
  if (rounds < 1 || rounds > 100000 || (argc > 1 && *end != '\0')) {
    std::fprintf(stderr, "usage: %s [rounds, 1 to 100000]\n", argv[0]);
    return 2;
  }
  Buffers b{Allocate(size_t{kTokens} * kSourceBytes, 1), Allocate(size_t{kTokens} * kSourceBytes, 0),
            Allocate(size_t{kTokens} * kRows * kCodeBytes, 0), Allocate(size_t{kTokens} * kRows * kScaleBytes, 0),
            std::vector<int>(kTokens / kPage)};
  for (size_t p = 0; p < b.page_of.size(); ++p) b.page_of[p] = static_cast<int>(p);
  std::shuffle(b.page_of.begin(), b.page_of.end(), std::mt19937(1));
  const size_t other_bytes = size_t{32} << 20;
  char* other = Allocate(other_bytes, 0);
  std::vector<double> ms[kPatterns];
  for (int round = 0; round < rounds; ++round)
    for (int p = 0; p < kPatterns; ++p) {
      std::memset(other, round, other_bytes);  // the caches hold other data when a round starts
      double call[5];
      for (double& c : call) c = Run(b, static_cast<Pattern>(p));
      std::sort(call + 2, call + 5);
      ms[p].push_back(call[3]);
    }
  std::printf("int8 prefill stores, %d tokens, %d heads of 128, MaxT %d, one core (%ld rounds, medians):\n", kTokens,
              kHeads, kTokens, rounds);
  std::sort(ms[0].begin(), ms[0].end());
  const double first = ms[0][ms[0].size() / 2];
  for (int p = 0; p < kPatterns; ++p) {
    std::sort(ms[p].begin(), ms[p].end());
    const double median = ms[p][ms[p].size() / 2];
    std::printf("  %-58s %.3f ms (%.2fx layout 0)\n", kNames[p], median, median / first);
  }
  return 0;
}
