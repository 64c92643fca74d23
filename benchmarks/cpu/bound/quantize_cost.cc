// What the CPU kernel's quantization costs per element on one core, next to the IEEE divisions the spec's formula
// takes: 9 division lanes per 8 elements with groups of 8 (one per element, one per group's scale; the AVX-512
// build takes 2, products with the scales' reciprocals standing in for the elements' divisions); and what
// dequantizing the rows back costs. Rows of float16 elements, 32,768 in all, stay in the core's caches, so this is
// the arithmetic alone. The argument is the row's length: 128 (one head row, as layout 3 stores them; the default)
// or 1024 (a token's 8 heads, as layouts 0-2 store them). From the repository root:
//
//   g++ -O3 -std=gnu++17 -ffp-contract=off -fno-fast-math -fno-trapping-math -Icpu -DKV_CPU_ISA=avx2
//       -mavx2 -mf16c -mfma benchmarks/cpu/bound/quantize_cost.cc -o /tmp/quantize_cost && /tmp/quantize_cost 1024
//
// (one command; -DKV_CPU_ISA=avx512 -mavx2 -mf16c -mfma -mavx512f -mavx512bw -mavx512vl for the AVX-512 build,
// -DKV_CPU_ISA=generic without the -m flags for the generic one).
//
// It also times the dequantizer as the gathers run it into large outputs: rows streamed to memory
// (DequantizeRowsStreamed) into an output on a 64-byte line, and 16 bytes past a line (where numpy's large arrays
// start) both with the rows chained as the gathers chain them and with their part lines held, interleaved. Rows of
// 128 go as layout 3's int8 gathers write them: tokens of 8 head rows, 4 heads an output row
// (StreamedGatherHeads(true) on AMD and the builds without AVX-512; Intel's AVX-512 build reads 8), heads 0-3 of every token in one pass and heads 4-7 in a second; other rows one after
// another.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "kv_cpu_quant_rows.h"

namespace {

using namespace kvcache;
using namespace kvcache::KV_CPU_ISA;

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per division lane at the width the build divides with (8 lanes with AVX, else 4), eight independent
// chains so that throughput, not latency, is measured.
#if defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float Vec __attribute__((vector_size(4 * kLanes)));  // divides with one divps / vdivps

double DivisionLaneSeconds() {
  Vec a[8];
  for (int i = 0; i < 8; ++i) a[i] = Vec{} + (1.0f + i);
  const Vec b = Vec{} + 1.0000001f;
  const long n = 20000000;
  const double start = Now();
  for (long i = 0; i < n; ++i) {
    for (int j = 0; j < 8; ++j) a[j] = a[j] / b;
    asm volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]), "+x"(a[4]), "+x"(a[5]), "+x"(a[6]), "+x"(a[7]));
  }
  const double t = Now() - start;
  float sink = 0;
  for (int j = 0; j < 8; ++j) sink += a[j][0];
  if (sink == 42) std::printf(" ");
  return t / (n * 8.0 * kLanes);
}

// What StreamedSeconds writes: `per_call` rows an output row, tokens of `per_token` rows (per_token / per_call
// passes over the tokens, as the gathers' passes over a token's heads).
struct StreamedOrder {
  int per_call, per_token;
};

// Seconds per element of DequantizeRowsStreamed over every row in `order`, medians of 15 rounds of 500 passes (32 MB
// written a round), the three ways interleaved round by round (streamed stores reach memory, whose speed drifts on
// a shared machine): [0] into an output on a line; [1] 16 bytes past a line, each output row chained to its
// neighbours as the gathers chain them (the last values of the row before lead its first line, and the row after
// writes the line they share: DequantizeRowsStreamed's lead and tail_follows); [2] the same, each row's part
// lines held in the table instead. 0 where this build does not stream such rows.
std::array<double, 3> StreamedSeconds(const std::vector<int8_t>& codes, const std::vector<uint16_t>& scales, int n,
                                      StreamedOrder order) {
  const int rows = static_cast<int>(codes.size()) / n, groups = n / 8;
  // Each pass writes the next slice of 64 MiB, twice the last-level cache of the machines measured, as the
  // gathers write outputs of hundreds of MB that are in no cache (a line in a cache changes what a store costs).
  const size_t slice = codes.size() * sizeof(F16::Storage), slices = (size_t{64} << 20) / slice;
  const size_t bytes = (slice * slices + 64 + 63) / 64 * 64;  // a multiple of the alignment
  std::array<unsigned char*, 3> storage{};
  for (auto& s : storage) {
    s = static_cast<unsigned char*>(std::aligned_alloc(64, bytes));
    if (s == nullptr) {
      std::fprintf(stderr, "out of memory\n");
      std::exit(1);
    }
  }
  LineStreams lines;
  std::vector<double> rounds[3];
  bool streamed[3] = {true, true, true};
  size_t next[3] = {0, 0, 0};  // each output's next slice
  // The last 16 groups of row r, the lead of the row after it in the output.
  auto lead_of = [&](int r) {
    return StreamedLead<int8_t, uint16_t>{codes.data() + r * n + (groups - 16) * 8, scales.data() + r * groups + groups - 16};
  };
  for (int round = 0; round < 45; ++round) {
    const int k = round % 3;
    const bool chained = k == 1 && groups >= 16;
    const double start = Now();
    for (int pass = 0; pass < 500 && streamed[k]; ++pass) {
      auto* out = reinterpret_cast<F16::Storage*>(storage[k] + (k ? 16 : 0) + next[k]++ % slices * slice);
      for (int h = 0; h < order.per_token; h += order.per_call)
        for (int t = 0; t + order.per_token <= rows && streamed[k]; t += order.per_token) {
          const Codes<8>::Storage* row_codes[8];
          const F16::Storage* row_scales[8];
          for (int q = 0; q < order.per_call; ++q) {
            row_codes[q] = codes.data() + (t + h + q) * n;
            row_scales[q] = scales.data() + (t + h + q) * groups;
          }
          // The row before in the output: the previous pass's last head of this token, or the last of the token
          // before; the row after: the next pass's, or the next token's first pass.
          const int before = h > 0 ? t + h - 1 : t - 1;
          const bool tail_follows = h + order.per_call < order.per_token || t + order.per_token < rows;
          streamed[k] = DequantizeRowsStreamed<F16, F16, 8>(
              row_codes, row_scales, order.per_call, 8, groups, out + (t + h) * n, lines,
              chained && before >= 0 ? lead_of(before) : StreamedLead<int8_t, uint16_t>{}, chained && tail_follows);
        }
    }
    lines.Flush();
    StoreFence();
    rounds[k].push_back((Now() - start) / (500.0 * n * rows));
  }
  for (unsigned char* s : storage) std::free(s);
  std::array<double, 3> seconds{};
  for (int k = 0; k < 3; ++k) seconds[k] = streamed[k] ? Median(rounds[k]) : 0;
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 128;
  if (n < 8 || n > 32768 || n % 8 != 0) {
    std::fprintf(stderr, "usage: %s [row length: a multiple of 8 from 8 to 32768, default 128]\n", argv[0]);
    return 2;
  }
  const int rows = 32768 / n, groups = n / 8;
  std::vector<uint16_t> src(n * rows);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  for (auto& v : src) v = F16::FromFloat(normal(gen));
  std::vector<int8_t> codes(n * rows);
  std::vector<uint16_t> scales(groups * rows);
  std::vector<float> x(n), scale(n), sf(groups + 8);
  std::vector<int32_t> work(n);
  const RowScratch scratch{x.data(), scale.data(), work.data(), sf.data()};
  std::vector<uint16_t> out(n * rows);
  std::vector<double> per_element, division, dequantized;
  for (int round = 0; round < 7; ++round) {
    std::vector<double> times, back;
    for (int rep = 0; rep < 300; ++rep) {
      double start = Now();
      for (int r = 0; r < rows; ++r)
        QuantizeRow<F16, F16, 8>(src.data() + r * n, n, 8, groups, codes.data() + r * n, scales.data() + r * groups,
                                 scratch);
      times.push_back((Now() - start) / (n * rows));
      start = Now();
      for (int r = 0; r < rows; ++r)
        DequantizeRow<F16, F16, 8>(codes.data() + r * n, scales.data() + r * groups, n, 8, groups,
                                   out.data() + r * n, scratch);
      back.push_back((Now() - start) / (n * rows));
    }
    per_element.push_back(Median(times));
    dequantized.push_back(Median(back));
    division.push_back(DivisionLaneSeconds() * 9.0 / 8.0);  // 9 lanes divided per 8 elements
  }
  const double q = Median(per_element), d = Median(division), dq = Median(dequantized);
  const StreamedOrder order = n == 128 ? StreamedOrder{4, 8} : StreamedOrder{1, 1};
  const auto [on_line, off_line, off_line_held] = StreamedSeconds(codes, scales, n, order);
  std::printf("int8 quantization (float16 in, float16 scales, groups of 8, rows of %d), medians of 7 rounds:\n", n);
  std::printf("  quantizer %.3f ns per element | the formula's IEEE divisions alone %.3f ns per element (%.0f%% of it)\n", q * 1e9,
              d * 1e9, 100.0 * d / q);
  std::printf("  dequantizer %.3f ns per element\n", dq * 1e9);
  char what[96];
  std::snprintf(what, sizeof what, "output rows of %d elements, %d passes a token", n * order.per_call,
                order.per_token / order.per_call);
  if (on_line > 0 && off_line > 0) {
    std::printf("  dequantizer streamed (%s; 15 rounds): %.3f ns per element on a line, %.3f 16 bytes past one "
                "(%.2fx), %.3f with part lines held (%.2fx)\n", what, on_line * 1e9, off_line * 1e9, on_line / off_line,
                off_line_held * 1e9, on_line / off_line_held);
  } else if (on_line > 0) {
    std::printf("  dequantizer streamed (%s; 15 rounds): %.3f ns per element on a line; 16 bytes past one this "
                "build streams through a scratch row instead\n", what, on_line * 1e9);
  } else {
    std::printf("  dequantizer streamed: not at this row length in this build\n");
  }
  // The benchmark's int8 prefill (B=4, seqlen 512, H=8, Dh=128) stores and gathers 4 * 512 * 8 * 128 keys and
  // as many values: its arithmetic alone, with every row in L1.
  const double elements = 2.0 * 4 * 512 * 8 * 128;
  std::printf("  int8 prefill's arithmetic (%.0f elements quantized, as many dequantized): %.2f ms\n", elements,
              (q + dq) * elements * 1e3);
  return 0;
}
