// The traffic of a float16 decode gather in token order (layouts 0 and 2), paged, with no arithmetic: each
// output row is a token's 8 heads of 128 (2,048 bytes) copied with streaming stores from a shuffled page of 64
// slots, and the bytes moved per second are compared with a glibc memcpy of the same bytes. It walks a gather
// task's 64 tokens of rows in the orders the CPU kernel has used: one row after another (tiles of 16 tokens,
// keys then values, two tokens of prefetch), and runs side by side (the task's rows, a token's key row then its
// value row, split into 4, 8 or 16 runs, 256 bytes of each run's row in turn, no software prefetch), plus runs of
// keys then values. Outputs on lines: it measures the order, not the edge lines. Then the kernel's own writer of
// runs side by side (cpu/kv_row_streams.h: WriteRowsSideBySide, 8 runs, each row led by the one before), into
// outputs on lines and 16 bytes past one, rows of 8 heads of 128 and of 32: the cost of the edge lines.
//
// From the repository root:
//
//   g++ -O2 -mavx2 -mf16c -mfma -mavx512f -mavx512bw -mavx512vl -DKV_CPU_ISA=avx512 -I. -std=c++17 benchmarks/cpu/bound/token_runs.cc -o /tmp/token_runs && /tmp/token_runs [rounds]
#include <immintrin.h>

#include "cpu/kv_row_streams.h"

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
constexpr size_t kWideRow = 4 * kRow;  // 32 heads of 128: a quarter of the tokens, the same bytes

struct Buffers {
  int layout = 0;  // 0: a slot's key row then its value row; 2: every key row, then every value row
  size_t row = kRow;  // bytes a row: kRow, or kWideRow with a quarter of the pages in use
  const std::vector<size_t>* pages = nullptr;  // the page table, shuffled
  char* cache = nullptr;
  char* out[2] = {nullptr, nullptr};

  size_t Tokens() const { return kTokens * kRow / row; }
  const char* Source(int kv, size_t token) const {
    const size_t slot = (*pages)[token / kPage] * kPage + token % kPage;
    if (layout == 2) return cache + (kv * Tokens() + slot) * row;
    return cache + (slot * 2 + kv) * row;
  }
  char* Output(int kv, size_t token) const { return out[kv] + token * row; }
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

// The kernel's writer: each task's rows (a token's key row then its value row) as 8 runs side by side, 256 bytes
// of each run's row in turn, outputs `offset` bytes past a line, every row led by the row before it in its output
// but a task's first (its first line held, as the kernel's gathers hold it).
void KernelRuns(const Buffers& b, size_t offset) {
  using namespace kvcache::avx512;
  LineStreams lines;
  std::vector<StreamedRow> rows(2 * kTask);
  for (size_t t0 = 0; t0 < b.Tokens(); t0 += kTask) {
    for (size_t i = 0; i < kTask; ++i)
      for (int kv = 0; kv < 2; ++kv) {
        const char* lead = i > 0 ? b.Source(kv, t0 + i - 1) + b.row - 64 : nullptr;
        rows[2 * i + kv] = {b.Source(kv, t0 + i), b.Output(kv, t0 + i) + offset, lead, i + 1 < kTask};
      }
    WriteRowsSideBySide(lines, rows.data(), static_cast<int64_t>(rows.size()), b.row, 8, 256);
    lines.Flush();
    _mm_sfence();
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

char* Filled(size_t bytes, int value) {
  char* p = static_cast<char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));  // a multiple of the alignment
  if (p == nullptr) {
    std::fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    std::exit(1);
  }
  std::memset(p, value, bytes);
  return p;
}

}  // namespace

using Orders = std::vector<std::pair<const char*, std::function<void()>>>;

// Each order's time against `copy`'s, the same bytes: medians of `rounds` interleaved rounds.
void Time(const Orders& orders, const char* title, long rounds, const std::function<void()>& copy) {
  std::vector<std::vector<double>> times(orders.size());
  std::vector<double> copies;
  for (long round = 0; round < rounds; ++round) {
    double start = Now();
    copy();
    copies.push_back(Now() - start);
    for (size_t k = 0; k < orders.size(); ++k) {
      start = Now();
      orders[k].second();
      _mm_sfence();
      times[k].push_back(Now() - start);
    }
  }
  const double median = Median(copies);
  std::printf("%s, pages of %zu slots: memcpy %.1f ms\n", title, kPage, median * 1e3);
  for (size_t k = 0; k < orders.size(); ++k)
    std::printf("  %-28s %6.1f ms  %.2fx\n", orders[k].first, Median(times[k]) * 1e3, median / Median(times[k]));
}

// A shuffled page table of `pages` pages.
std::vector<size_t> Shuffled(size_t pages) {
  std::vector<size_t> table(pages);
  for (size_t i = 0; i < pages; ++i) table[i] = i;
  std::mt19937 random(1);
  std::shuffle(table.begin(), table.end(), random);
  return table;
}

int main(int argc, char** argv) {
  char* end = nullptr;
  const long rounds = argc > 1 ? std::strtol(argv[1], &end, 10) : 7;
  if (argc > 2 || (argc > 1 && *end != '\0') || rounds < 1 || rounds > 1000) {
    std::fprintf(stderr, "usage: %s [rounds, 1 to 1000, default 7]\n", argv[0]);
    return 2;
  }
  Buffers b;
  const std::vector<size_t> pages = Shuffled(kTokens / kPage), wide_pages = Shuffled(kTokens * kRow / kWideRow / kPage);
  b.pages = &pages;
  const size_t moved = 2 * kTokens * kRow;  // bytes written (and read) a call
  b.cache = Filled(moved, 1);
  b.out[0] = Filled(moved / 2 + 64, 2);  // room for the rows 16 bytes past a line
  b.out[1] = Filled(moved / 2 + 64, 2);
  char* copy_from = Filled(moved, 1);
  char* copy_to = Filled(moved, 3);
  const Orders orders = {
      {"one row after another", [&] { RowAfterRow(b); }},
      {"4 runs, token-major", [&] { RunsSideBySide(b, 4, true); }},
      {"8 runs, token-major", [&] { RunsSideBySide(b, 8, true); }},
      {"16 runs, token-major", [&] { RunsSideBySide(b, 16, true); }},
      {"8 runs, keys then values", [&] { RunsSideBySide(b, 8, false); }},
  };
  auto rows_of = [&](size_t row) { b.row = row, b.pages = row == kRow ? &pages : &wide_pages; };
  const Orders kernel = {
      {"kernel, 8 heads, on lines", [&] { rows_of(kRow), KernelRuns(b, 0); }},
      {"kernel, 8 heads, 16 B past", [&] { rows_of(kRow), KernelRuns(b, 16); }},
      {"kernel, 32 heads, on lines", [&] { rows_of(kWideRow), KernelRuns(b, 0); }},
      {"kernel, 32 heads, 16 B past", [&] { rows_of(kWideRow), KernelRuns(b, 16); }},
  };
  std::printf("median of %ld rounds; ratio = memcpy's time / the order's, the same bytes\n", rounds);
  for (int layout : {0, 2}) {
    b.layout = layout;
    Time(orders, layout == 0 ? "layout 0" : "layout 2", rounds, [&] { std::memcpy(copy_to, copy_from, moved); });
  }
  b.layout = 0;  // the kernel's rows: layout 0
  Time(kernel, "the kernel's writer, layout 0", rounds, [&] { std::memcpy(copy_to, copy_from, moved); });
  return 0;
}
