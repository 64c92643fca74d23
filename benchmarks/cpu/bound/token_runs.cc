// The traffic of a float16 decode gather in token order (layouts 0 and 2), paged, with no arithmetic: each
// output row is a token's 8 heads of 128 (2,048 bytes) copied with streaming stores from a shuffled page of 64
// slots, and the bytes moved per second are compared with a glibc memcpy of the same bytes. It walks a gather
// task's 64 tokens of rows in the orders the CPU kernel has used: one row after another (tiles of 16 tokens,
// keys then values, two tokens of prefetch), and runs side by side (the task's rows, a token's key row then its
// value row, split into 4, 8 or 16 runs, 256 bytes of each run's row in turn, no software prefetch), plus runs of
// keys then values. Outputs on lines only: it measures the order, not the edge lines.
//
//   g++ -O2 -mavx512f -std=c++17 benchmarks/cpu/bound/token_runs.cc -o /tmp/token_runs && /tmp/token_runs
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <utility>
#include <vector>

namespace {

constexpr size_t kRow = 2048;    // a token's 8 heads of 128, float16
constexpr size_t kBatch = 64;    // sequences
constexpr size_t kKeys = 1024;   // keys a sequence
constexpr size_t kPage = 64;     // slots a page
constexpr size_t kTask = 64;     // tokens a gather task
constexpr size_t kTokens = kBatch * kKeys;

struct Buffers {
  int layout = 0;  // 0: a slot's key row then its value row; 2: every key row, then every value row
  std::vector<size_t> pages;  // the page table, shuffled
  char* cache = nullptr;
  char* out[2] = {nullptr, nullptr};

  const char* Source(int kv, size_t token) const {
    const size_t slot = pages[token / kPage] * kPage + token % kPage;
    if (layout == 2) return cache + (kv * pages.size() * kPage + slot) * kRow;
    return cache + (slot * 2 + kv) * kRow;
  }
  char* Output(int kv, size_t token) const { return out[kv] + token * kRow; }
};

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void StreamBytes(char* dst, const char* src, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
}

void Prefetch(const char* src) {
  for (size_t i = 0; i < kRow; i += 64) _mm_prefetch(src + i, _MM_HINT_T0);
}

// One row after another: tiles of 16 tokens, a tile's key rows then its value rows, two tokens ahead asked for.
void RowAfterRow(const Buffers& b) {
  for (size_t t0 = 0; t0 < kTokens; t0 += 16)
    for (int kv = 0; kv < 2; ++kv)
      for (size_t i = t0; i < t0 + 16; ++i) {
        if (i + 2 < kTokens) Prefetch(b.Source(kv, i + 2));
        StreamBytes(b.Output(kv, i), b.Source(kv, i), kRow);
      }
}

// The task's 128 rows split into `runs` runs of consecutive rows, 256 bytes of each run's current row in turn.
// token_major: a token's key row then its value row; else the task's key rows, then its value rows.
void RunsSideBySide(const Buffers& b, size_t runs, bool token_major) {
  constexpr size_t kChunk = 256;
  const size_t length = 2 * kTask / runs;
  std::vector<const char*> src(runs);
  std::vector<char*> dst(runs);
  for (size_t t0 = 0; t0 < kTokens; t0 += kTask)
    for (size_t r = 0; r < length; ++r) {
      for (size_t j = 0; j < runs; ++j) {
        const size_t q = j * length + r;
        const int kv = token_major ? static_cast<int>(q & 1) : static_cast<int>(q / kTask);
        const size_t token = t0 + (token_major ? q / 2 : q % kTask);
        src[j] = b.Source(kv, token);
        dst[j] = b.Output(kv, token);
      }
      for (size_t c = 0; c < kRow; c += kChunk)
        for (size_t j = 0; j < runs; ++j) StreamBytes(dst[j] + c, src[j] + c, kChunk);
    }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

char* Filled(size_t bytes, int value) {
  char* p = static_cast<char*>(std::aligned_alloc(4096, bytes));
  if (p == nullptr) {
    std::fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    std::exit(1);
  }
  std::memset(p, value, bytes);
  return p;
}

}  // namespace

int main() {
  Buffers b;
  b.pages.resize(kTokens / kPage);
  for (size_t i = 0; i < b.pages.size(); ++i) b.pages[i] = i;
  std::mt19937 random(1);
  std::shuffle(b.pages.begin(), b.pages.end(), random);
  const size_t moved = 2 * kTokens * kRow;  // bytes written (and read) a call
  b.cache = Filled(moved, 1);
  b.out[0] = Filled(moved / 2, 2);
  b.out[1] = Filled(moved / 2, 2);
  char* copy_from = Filled(moved, 1);
  char* copy_to = Filled(moved, 3);
  const std::vector<std::pair<const char*, std::function<void()>>> orders = {
      {"one row after another", [&] { RowAfterRow(b); }},
      {"4 runs, token-major", [&] { RunsSideBySide(b, 4, true); }},
      {"8 runs, token-major", [&] { RunsSideBySide(b, 8, true); }},
      {"16 runs, token-major", [&] { RunsSideBySide(b, 16, true); }},
      {"8 runs, keys then values", [&] { RunsSideBySide(b, 8, false); }},
  };
  std::printf("median of 7 rounds; ratio = memcpy's time / the order's, the same bytes\n");
  for (int layout : {0, 2}) {
    b.layout = layout;
    std::vector<std::vector<double>> times(orders.size());
    std::vector<double> copies;
    for (int round = 0; round < 7; ++round) {
      double start = Now();
      std::memcpy(copy_to, copy_from, moved);
      copies.push_back(Now() - start);
      for (size_t k = 0; k < orders.size(); ++k) {
        start = Now();
        orders[k].second();
        _mm_sfence();
        times[k].push_back(Now() - start);
      }
    }
    const double copy = Median(copies);
    std::printf("layout %d, pages of %zu slots: memcpy %.1f ms\n", layout, kPage, copy * 1e3);
    for (size_t k = 0; k < orders.size(); ++k)
      std::printf("  %-26s %6.1f ms  %.2fx\n", orders[k].first, Median(times[k]) * 1e3, copy / Median(times[k]));
  }
  return 0;
}
