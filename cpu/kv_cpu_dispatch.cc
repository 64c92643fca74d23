// Picks the CPU kernel build for this processor. Every op has up to three builds: AVX-512 (F, BW, VL) with
// F16C and FMA, AVX2 + F16C + FMA, and generic. CMake adds the x86-64 builds,
// and defines KVCACHE_CPU_AVX2 / KVCACHE_CPU_AVX512 here, only where the compiler targets x86-64. The best
// build the processor runs is used; $KVCACHE_OP_CPU_KERNEL = generic | avx2 | avx512 caps the choice (tests
// run every build). KeyValueCache's builds compute identical bits; MultiHeadAttention's differ only in the
// summation order of dot products (within the spec's tolerance); only the speed differs.
#include "kv_cpu.h"
#include "mha_cpu.h"
#include "mhca_cpu.h"
#include "stored_rows_backup.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace kvcache {
namespace generic {
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);
void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for);
void MhcaComputeCpu(const MhcaArgs& args, const ParallelFor& parallel_for);
}
#ifdef KVCACHE_CPU_AVX2
namespace avx2 {
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);
void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for);
void MhcaComputeCpu(const MhcaArgs& args, const ParallelFor& parallel_for);
}
#endif
#ifdef KVCACHE_CPU_AVX512
namespace avx512 {
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);
void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for);
void MhcaComputeCpu(const MhcaArgs& args, const ParallelFor& parallel_for);
}
#endif

namespace {

enum class CpuKernel { kGeneric, kAvx2, kAvx512 };

// The cap from $KVCACHE_OP_CPU_KERNEL (read each call: tests switch it); unset or unknown: no cap.
CpuKernel KernelCap() {
  const char* choice = std::getenv("KVCACHE_OP_CPU_KERNEL");
  if (choice == nullptr) return CpuKernel::kAvx512;
  if (std::strcmp(choice, "generic") == 0) return CpuKernel::kGeneric;
  if (std::strcmp(choice, "avx2") == 0) return CpuKernel::kAvx2;
  return CpuKernel::kAvx512;
}

// The best build this library has and this processor runs (__builtin_cpu_supports is x86-only, hence the
// guards).
CpuKernel BestKernel() {
#ifdef KVCACHE_CPU_AVX512
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
                             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  if (avx512) return CpuKernel::kAvx512;
#endif
#ifdef KVCACHE_CPU_AVX2
  static const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  if (avx2) return CpuKernel::kAvx2;
#endif
  return CpuKernel::kGeneric;
}

CpuKernel ChosenKernel() {
  const CpuKernel best = BestKernel(), cap = KernelCap();
  return static_cast<int>(cap) < static_cast<int>(best) ? cap : best;
}

}  // namespace

// 1 where $name is `on`, 0 where it is `off`, else -1 (unset, or another word: the measured choice). Read each
// call: tests and benchmarks switch it.
static int EnvSwitch(const char* name, const char* on, const char* off) {
  const char* choice = std::getenv(name);
  if (choice != nullptr && std::strcmp(choice, on) == 0) return 1;
  if (choice != nullptr && std::strcmp(choice, off) == 0) return 0;
  return -1;
}

// Whether the measured choices below follow an AMD processor's: where this is one (__builtin_cpu_is is x86-only:
// elsewhere false), or as $KVCACHE_OP_CPU_VENDOR says ("amd" or "intel"), so that tests hold each kind's rules on
// any machine and one kind's choices can be timed on the other. Every choice gives the same bits.
static bool AmdProcessor() {
  const int named = EnvSwitch("KVCACHE_OP_CPU_VENDOR", "amd", "intel");
  if (named >= 0) return named == 1;
#ifdef KVCACHE_CPU_AVX2
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

StorePlan LargeOutputStores() {
  const char* choice = std::getenv("KVCACHE_OP_STORES");  // read each call: tests and benchmarks switch it
  if (choice != nullptr && std::strcmp(choice, "side-by-side") == 0) return {true, true};
  if (choice != nullptr && std::strcmp(choice, "cached") == 0) return {false, false};  // "stream": the default
  // Measured on one core, decode B=64 with 1,024 keys, 8 heads of 128 (benchmarks/cpu), streaming stores walking
  // one source stream against four side by side: on an AMD EPYC (Zen 5) 0.84-0.86x a copy in layout 0 whatever
  // the output's alignment against 0.57x; on an Intel Xeon of family 6 model 207 0.81-0.93x in layouts 0-2
  // against 0.72-0.76x (layout 3 0.97x both); on an Intel Xeon of family 6 model 167 (side by side in one
  // process, 7 rounds, on lines / 16 bytes past) layout 0 0.86x / 0.86x against 0.77x / 0.60x, layout 1 0.84x /
  // 0.81x against 0.79x / 0.65x, layout 2 0.77-0.83x / 0.82-0.85x against 0.79-0.82x / 0.53-0.62x, layout 3
  // 1.06x / 1.05x against 0.94x / 0.58x, 32 heads of 128 in layout 3 1.06x / 0.97x against 0.63x / 0.50x; cached
  // stores 0.46-0.54x. One stream on every processor: the first Intel Xeon measured (its model not recorded),
  // with the kernel of then, had four side by side ahead (1.08-1.21x against 0.74-0.97x), but no processor has
  // measured them ahead since streamed rows off a line are chained (benchmarks/cpu/bound).
  return {true, false};
}

bool CachedGatherHeadRuns() {
  const int choice = EnvSwitch("KVCACHE_OP_CACHED_GATHER", "head-runs", "tokens");
  if (choice >= 0) return choice == 1;
  // Measured on one core, int8 prefill B=4 x 512 tokens, 8 heads of 128, layout 3 (benchmarks/cpu): on an AMD
  // EPYC (Zen 5) a head's page runs 1.12-1.17 ms against 1.26-1.42 token by token; on an Intel Xeon token by
  // token ran at 0.60-0.71x a copy and head by head (row by row, before page runs) 0.46-0.61x. Other
  // processors keep the Intel choice. (Measured when that prefill's outputs came from the gathers; the stores
  // now write a stored token's outputs, so this orders the gathers of what a call loads without storing it: a
  // chunked prefill's earlier tokens, a small decode's.) On an Intel Xeon of family 6 model 167, side by side in
  // one process (9 rounds), the chunk of a chunked prefill, int8 layout 3: token by token 3.72 ms (0.61x a copy)
  // against 4.81 ms (0.48x) a head's page runs; float16 and layout 0 within noise. On an Intel Xeon of family 6
  // model 207 (11 rounds, op / copy on lines / 16 bytes past), the same chunk: token by token 0.71x / 0.70x against
  // 0.72x / 0.62x, offset 0.79x / 0.67x against 0.70x / 0.65x; float16 and int8 prefill level.
  return AmdProcessor();
}

// The integer $name holds where it is one (whole, in base 10) of at least `least`; else -1. Read each call, as
// $KVCACHE_OP_STORES: tests and benchmarks switch it.
static long long EnvInteger(const char* name, long long least) {
  const char* text = std::getenv(name);
  if (text == nullptr) return -1;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return end != text && *end == '\0' && value >= least ? value : -1;
}

int64_t StreamedGatherHeads(bool quantized) {
  const long long heads = EnvInteger("KVCACHE_OP_STREAMED_HEADS", 1);
  if (heads > 0) return heads < kMaxStreamedHeads ? heads : kMaxStreamedHeads;
  // Measured on one core, decode B=64 with 1,024 keys, 8 heads of 128, layout 3 (benchmarks/cpu). On the Intel
  // Xeon of family 6 model 207: int8 into outputs on lines 0.67-0.75x a copy a head at a time, 0.71-0.81x two,
  // 0.77-0.83x four, 0.76-0.80x eight; 16 bytes past a line 0.44-0.55x, 0.62-0.68x, 0.66-0.70x, 0.66-0.69x;
  // float16, 16 bytes past a line, 0.66x a head a row, 0.93-0.94x four or eight (on lines 0.90-1.01x either way;
  // then token by token). On an AMD EPYC of family 25 model 17 (Zen 4): int8 on lines 0.75x, 0.81x, 0.85x, 0.73x
  // (one, two, four, eight heads); 16 bytes past a line 0.48x, 0.53x, 0.58x, 0.58x. Four for quantized rows, each
  // head two source streams (codes and scales). Values walked a page run at a time, one stream a head, on that
  // AMD EPYC, side by side in one process (on lines / 16 bytes past): 8 heads of 128 0.81x / 0.81x (two heads a
  // pass), 0.95-0.97x / 0.92-0.93x (four), 0.98x / 1.00x (eight); 32 heads of 128 (B=16) 0.83x / 0.82x, 0.98x / 0.97x,
  // 0.94-0.97x / 0.97-0.98x, sixteen 0.76x / 0.78x (token by token 0.43-0.48x); 16 heads of 64 0.67x / 0.65x, 0.82x /
  // 0.75x, 0.86x / 0.80-0.82x, sixteen 0.78x / 0.84x. Eight for values: in both cases eight source streams a pass,
  // what the cache's sets hold (the rows' addresses share their low bits: kv_cpu.cc, GatherRows). On an Intel Xeon
  // of family 6 model 167, values, side by side (7 rounds, on lines / 16 bytes past): 8 heads of 128 1.10x /
  // 0.81x (four), 1.08x / 1.07x (eight), 1.08x / 1.13x (sixteen); 32 heads of 128 1.09x / 1.09x, 1.05x / 1.00x,
  // 0.91x / 0.77x; pages of 16 slots 0.98x / 0.81x, 0.95x / 0.94x, 0.94x / 0.93x: eight there too (sixteen with 8
  // heads runs eight, the count capped at the call's heads: its columns there are that machine's noise).
  // Quantized rows on that Intel Xeon of model 167, int8, four heads against eight, side by side (7 rounds, on lines /
  // 16 bytes past): decode B=64 x 1,024 keys, paged, 0.80x / 0.68x against 0.82x / 0.76x, offset 0.79x / 0.69x
  // against 0.86x / 0.76x; 32 heads of 128 (B=16) 0.75x / 0.67x against 0.81x / 0.66x, offset 0.82x / 0.76x against
  // 0.94x / 0.75x; pages of 16 slots 0.61x / 0.49x against 0.62x / 0.65x, offset 0.80x / 0.71x against 0.82x / 0.79x:
  // eight ahead or level everywhere, so Intel processors running the AVX-512 build read eight (int4 not measured, it
  // follows int8). On an Intel Xeon of family 6 model 207 (11 rounds, on lines / 16 bytes past), eight against four:
  // int8 decode, paged, 0.80x / 0.85x against 0.79x / 0.74x; 32 heads 0.85x / 0.78x against 0.81x / 0.75x; pages of
  // 16 slots 0.77x / 0.75x against 0.84x / 0.61x; values (float16): four level on lines, 1.08x eight's time 16
  // bytes past one (decode), sixteen 1.06x / 1.09x with 32 heads of 128.
  // AMD processors and the other builds keep four.
  if (quantized && (ChosenKernel() != CpuKernel::kAvx512 || AmdProcessor())) return 4;
  return 8;
}

int64_t GatherTileBytes(bool key_value_together, bool quantized) {
  const long long bytes = EnvInteger("KVCACHE_OP_GATHER_TILE", 0);
  if (bytes >= 0) return bytes;
  // Measured on one core, float16 decode B=64 with 1,024 keys, 8 heads of 128 (benchmarks/cpu), tiles of 32 KiB
  // against a token at a time. Where a token's key and value rows lie together in the cache (layouts 0 and 1), a
  // token at a time reads them as one run. On the Intel Xeon of family 6 model 207: layout 0 0.83-0.84x a copy
  // (tiles) against 0.87x (a token), offset 0.85-0.86x against 0.91-0.92x, layout 1 0.86x against 0.94x; 16 bytes
  // past a line 0.76-0.88x against 0.81-0.89x; the chunk of a chunked prefill (outputs that stay cached)
  // 0.88-0.94x against 0.96-0.98x. On an AMD EPYC of family 25 model 17 (Zen 4): layout 0 0.69-0.72x against
  // 1.15-1.24x, layout 1 0.69x against 1.01x, offset 0.71x against 1.18x; 16 bytes past a line 0.61-0.65x
  // against 1.00-1.04x (tiles of 4, 8, 16 and 128 KiB as 32 KiB). Where they lie apart (layouts 2 and 3) a token
  // at a time alternates between two distant runs of each: on that AMD EPYC layout 2 1.01-1.05x (a token) against
  // 1.06-1.26x (32 KiB), 16 bytes past a line 0.69-0.87x against 0.87-0.99x; on the Intel Xeon 0.96x against
  // 0.94x (within its noise); layout 3 within noise on the AMD EPYC (0.96x either way; 0.85x either way past a
  // line), not measured on the Intel Xeon.
  // Later, on that AMD EPYC (float16 decode, paged, side by side, on lines / 16 bytes past): layout 2 1.02x / 0.99x
  // (32 KiB), 1.12x / 1.08x (128 KiB), 1.12x / 1.16x (512 KiB); with 32 heads of 128 (B=16) 0.87x / 0.85x, 1.02x /
  // 0.92x, 1.01x / 0.99x: fewer turns between the distant key and value runs; the chunk of a chunked prefill
  // (outputs that stay cached) level, layout 2 0.61x against 0.65x (512 KiB), layout 3 0.65x either way. 512 KiB
  // there (a task's 64 tokens of rows up to 8 KiB); 32 KiB elsewhere, as measured on the Intel Xeons (against a
  // token at a time only). Layout 3's streamed float16 gathers walk page runs a few heads at a time instead
  // (StreamedGatherHeads); its tiles serve outputs that stay cached. Quantized gathers in token order take the
  // same tiles in layouts 0-2 (on that AMD EPYC, int8 decode with 32 heads of 128 in layout 2: 0.84x a token at a
  // time, 0.98x in 512 KiB tiles; kv_cpu.cc). On an Intel Xeon of family 6 model 167, layout 2 side by side (7
  // rounds, on lines / 16 bytes past), a token, 32 KiB and 512 KiB: float16 decode 0.91x / 0.85x, 0.81x / 0.85x,
  // 0.76x / 0.87x; with 32 heads of 128 0.76x / 0.73x, 0.75x / 0.75x, 0.79x / 0.79x; int8 decode 0.96x / 0.86x,
  // 0.92x / 0.86x, 0.91x / 0.89x; int8 with 32 heads 0.77x / 0.74x, 0.79x / 0.73x, 0.77x / 0.74x: all within
  // that machine's noise, so Intel processors keep 32 KiB. On an Intel Xeon of family 6 model 207, two runs (11
  // and 15 rounds), a token against 32 KiB: int8 decode 0.96x / 0.95x and 0.98x / 0.98x against 0.92x / 0.96x and
  // 0.89x / 0.94x; 32 heads 0.87x / 0.83x either run against 0.86-0.87x / 0.79-0.84x; the float16 chunk 1.03x /
  // 0.97x and 1.00x / 1.02x against 0.93x / 0.94x and 1.04x / 1.01x (512 KiB 0.94-0.95x there, 0.80-0.95x over
  // every case); layout 3's chunk level
  // (float16 0.93x / 0.91x against 0.94x / 0.92x): within noise, 32 KiB kept for unquantized rows. int8 decode with
  // 8 heads in layout 2 was the exception, a token at a time ahead in each run, and in a third (21 rounds): 0.98x /
  // 0.97x against 0.95x / 0.92x, pages of 16 slots 0.98x / 0.97x against 0.95x / 0.93x (the time 0.96-0.97x the
  // tiles'), 32 heads and the int8 chunk level (0.97-1.00x); on model 167 too (0.96x against 0.92x on lines, level
  // past one). So on Intel processors quantized gathers go a token at a time in every layout (they went so before
  // AMD's tiles reached them unmeasured; layout 3's always do), and side by side after the change 32 KiB took
  // 1.02-1.10x its time on int8 decode there; unquantized ones keep 32 KiB, level there. Where
  // token streams run (TokenStreams, below, above 1) the streamed unquantized gathers of layouts 0-2 read runs of a
  // task's rows side by side instead of tiles; the tiles serve the rest.
  const bool amd = AmdProcessor();
  if (key_value_together || (quantized && !amd)) return 0;
  return amd ? int64_t{512} << 10 : int64_t{32} << 10;
}

int64_t TokenStreams() {
  const long long streams = EnvInteger("KVCACHE_OP_TOKEN_STREAMS", 1);
  if (streams > 0) return streams < kMaxTokenStreams ? streams : kMaxTokenStreams;
  // Measured on an Intel Xeon of family 6 model 167, one core, float16 decode B=64 with 1,024 keys, 8 heads of 128
  // (benchmarks/cpu/intel-xeon-167). First the traffic alone (benchmarks/cpu/bound/token_runs.cc; these figures its
  // first runs, its later two in that folder's README), a task's 64 tokens of rows copied as the gathers copy
  // them, paged (shuffled pages of 64 slots), against a glibc memcpy of the same bytes: one row after another
  // (tiles of 16 tokens, two tokens of prefetch, as the gathers did) 0.77-0.90x in layouts 0 and 2; the task's
  // rows, a token's key row then its value row, as 4 runs side by side (256 bytes of each run's row in turn, no
  // software prefetch) 1.03-1.09x, as 8 runs 1.10-1.14x, 16 runs 1.10-1.16x (chunks of 128 to 512 bytes level;
  // with two rows of prefetch 0.83-0.86x; four runs of four tokens, the old side-by-side tiles, 0.81-0.83x). Keys
  // then values, 8 runs: 1.14x in layout 2, 0.83x in layout 0, whose key rows alternate with value rows. Then the
  // kernel, side by side in one process against one row after another (5-7 rounds, on lines): 1, 8 and 16 runs,
  // layout 0 paged 0.85-0.91x, 1.05-1.13x, 1.09-1.10x; offset 0.85-0.88x, 1.04-1.14x, 1.10x; layout 2 0.81-0.87x,
  // 1.03-1.07x, 1.01-1.03x; 32 heads of 128 in layout 2 0.76-0.80x, 1.09-1.10x, 1.13x. 16 bytes past a line,
  // layout 0 0.85-0.89x, 0.97-1.08x, 1.04x. Prefill (outputs that stay cached) level.
  // On an AMD EPYC of family 25 model 17 (Zen 4), the kernel side by side in one process (7 rounds, paged unless
  // named, on lines / 16 bytes past), one row after another (in tiles in layout 2) against 4 and 8 runs: layout 0
  // 1.12x / 0.88x, 1.23x / 1.13x, 1.23x / 1.03x; layout 1 1.08x / 1.10x, 1.23x / 1.30x, 1.27x / 1.09x; offset 1.12x /
  // 1.04x, 1.37x / 1.20x, 1.21x / 1.20x; layout 2 1.10x / 1.07x, 1.17x / 0.99x, 1.03x / 0.88x; 32 heads of 128 in
  // layout 0 0.87x / 0.89x, 1.35x / 1.35x, 1.31x / 1.21x, in layout 2 1.08x / 1.01x, 1.31x / 1.15x, 1.15x / 1.10x;
  // pages of 16 slots, layout 0, 0.95x / 0.92x, 1.38x / 1.39x, 1.30x / 1.06x, layout 2 0.88x / 0.80x, 1.05x / 0.96x,
  // 1.03x / 0.93x. A second run with 2 runs too (one, 2, 4, 8): layout 0 1.13x / 0.89x, 1.37x / 1.21x, 1.29x /
  // 1.16x, 1.35x / 1.09x; layout 2 0.97x / 1.08x, 0.93x / 0.83x, 1.06x / 1.00x, 1.01x / 0.84x; 32 heads, layout 1,
  // 0.92x / 0.91x, 1.44x / 1.51x, 1.40x / 1.22x, 1.33x / 1.22x; 16 heads of 128 (B=32), layout 2, 1.08x / 1.04x,
  // 1.23x / 1.22x, 1.15x / 1.17x, 1.07x / 0.96x; pages of 16, layout 1, 0.91x / 0.92x, 1.27x / 1.30x, 1.28x / 1.18x,
  // 1.35x / 1.21x. Four there: 2 ahead of it in four of those five rows but behind in layout 2 with 8 heads (the
  // benchmark's decode); four ahead of one row after another everywhere but there 16 bytes past a line, where one
  // row after another in 512 KiB tiles stays a little ahead (1.07-1.08x against 0.99-1.00x).
  // On an Intel Xeon of family 6 model 207 (11 rounds, on lines / 16 bytes past), 8 runs against one and 16, layouts
  // 0-2: decode 0.95-1.01x / 0.86-0.97x against 0.82-0.88x / 0.85-0.87x and 0.92-0.99x / 0.88-0.95x; 32 heads of 128
  // 1.04x / 0.92-0.97x against 0.81-0.84x / 0.76-0.81x and 1.01-1.02x / 0.92-0.93x; pages of 16 slots 0.96-0.99x /
  // 0.86-0.96x against 0.84-0.87x / 0.83-0.84x and 0.93-0.98x / 0.85-0.90x. The traffic alone there: one row after
  // another 0.87-0.93x a memcpy, 8 runs 1.00-1.05x.
  if (ChosenKernel() != CpuKernel::kAvx512) return 1;
  return AmdProcessor() ? 4 : 8;
}

int64_t TokenPrefetchBytes(int64_t row_bytes) {
  const long long bytes = EnvInteger("KVCACHE_OP_TOKEN_PREFETCH", 0);
  if (bytes >= 0) return bytes;
  // A token's whole row asked for at once is a burst of requests, one a line, that the core's line fill buffers
  // cannot all take: the loads of the row being dequantized queue behind them. The row's first kilobyte starts the
  // hardware prefetchers down the new run, which fetch the rest as it is read. Measured on an Intel Xeon of family 6
  // model 167, one core, int8 with 32 heads of 128 (4 KiB of codes a token), paged, side by side in one process (3
  // rounds, on lines / 16 bytes past, a copy of the same bytes = 1). Decode B=16 with 1,024 keys, first separate
  // builds: the whole row, none, 1 KiB: layout 0 0.73x / 0.66x, 0.86x / 0.84x, 0.99x / 0.87x; layout 1 0.77x /
  // 0.65x, 0.82x / 0.77x, 0.89x / 0.79x. Then this setting: the whole row, 512 B, 1 KiB, 2 KiB: layout 0 0.73x /
  // 0.71x, 0.89x / 0.88x, 0.90x / 0.84x, 0.79x / 0.77x; layout 2 0.74x / 0.74x, 0.84x / 0.80x, 0.89x / 0.75x,
  // 0.78x / 0.76x; layout 1, the whole row against 1 KiB, 0.74x / 0.66x against 0.85x / 0.80x; a prefill chunk of
  // 4 x 256 tokens after 768 (outputs that stay cached), layout 0, 0.77x / 0.75x against 0.85x / 0.81x. Rows of
  // 1 KiB (8 heads of 128) are asked for whole either way (level, within the machine's noise).
  // On an AMD EPYC of family 25 model 17 (Zen 4), one core, decode with 1,024 keys, paged unless named, side by side
  // in one process (9 rounds, on lines / 16 bytes past), the whole row against 128 B, 256 B, 512 B and 1 KiB. Rows
  // of 4 KiB (32 heads of 128, B=16): layout 0 0.95-1.00x / 0.88-0.91x, 1.20x / 1.01x, 1.12x / 1.06x, 1.11-1.20x /
  // 1.04-1.15x, 1.08x / 0.98x; layout 1 0.90x / 0.90x, 512 B 1.14x / 1.11x, 1 KiB 0.91x / 0.93x; layout 2
  // 0.97-1.01x / 0.89-0.97x, 1.08x / 1.00x, 1.18x / 1.14x, 1.18-1.19x / 1.11-1.15x, 1.12x / 1.04x; offset 0.93x /
  // 0.91x, 512 B 1.01x / 1.08x, 1 KiB 0.96x / 0.97x. Rows of 8 KiB (64 heads, B=8), layout 0: 0.94x / 0.86x, 512 B
  // 1.30x / 1.13x, 1 KiB 1.14x / 1.07x. Rows of 2 KiB (16 heads, B=32): layout 0 0.94x / 0.88x, 512 B 1.04x /
  // 1.02x, 1 KiB 1.08x / 1.02x; layout 2 1.02x / 0.92x, 1.17x / 1.03x, 1.10x / 1.05x. Rows of 1 KiB (8 heads, B=64),
  // where 1 KiB is the whole row: layout 0 1.15x / 1.00x against 0.97x / 0.96x (128 B), 0.98x / 0.90x (256 B),
  // 1.01x / 0.92x (512 B); layout 1 1.13x / 1.02x against 1.04x / 0.96x (512 B); layout 2 1.13x / 1.03x against
  // 1.02x / 0.95x (512 B); pages of 16 slots, layout 0, 1.05x / 0.93x against 0.89x / 0.84x (512 B). There a row of
  // a kilobyte or less is asked for whole, a longer one its first 512 bytes.
  // On an Intel Xeon of family 6 model 207 (11 rounds, on lines / 16 bytes past), 1 KiB against the whole row, int8
  // with 32 heads of 128, layouts 0-2: decode B=16 0.83-0.89x / 0.77-0.82x against 0.76-0.77x / 0.70-0.72x; the chunk
  // (4 x 256 tokens after 768) 1.06-1.41x / 1.00-1.22x against 0.98-1.19x / 1.06-1.10x, the whole row's time
  // 1.05-1.18x 1 KiB's throughout.
  if (!AmdProcessor()) return 1024;
  return row_bytes > 1024 ? 512 : 0;
}

bool StreamedCodeStores() {
  const int choice = EnvSwitch("KVCACHE_OP_CODE_STORES", "stream", "cached");
  if (choice >= 0) return choice == 1;
  // Measured on one core, int8 B=4 x 512-token prefill, 8 heads of 128 (benchmarks/cpu), streaming against plain
  // code stores side by side, medians (fastest rounds) in ms. On an AMD EPYC of family 25 model 17 (Zen 4): layout
  // 3 2.13 (1.43) against 2.44 (2.18), offset mode 2.08 (1.30) against 2.44 (1.72), layout 2 1.41 (0.99) against
  // 1.97 (1.04), layouts 0 and 1 level (1.64 / 1.28 against 1.69 / 1.25); the chunk of a chunked prefill, layout 3,
  // 3.37 (2.79) against 3.76 (3.15); decode B=64 level in layouts 0, 2 and 3. Layout 3 keeps a token's head rows a
  // multiple of 4 KiB apart where MaxT is a power of two, so plain stores bring all of them into the same few sets
  // of the core's cache, where they evict each other and the rows around them; streaming stores take no line into
  // the cache. A cache row written is read again at the next step, by then long evicted. With the codes, layout
  // 3's scale rows go out as whole streamed lines (InterleavedStreams): side by side on that AMD EPYC, layout 3's
  // int8 prefill 4-23% faster in four runs of five, level in one (op / copy 0.64x -> 0.75x, 1.46 -> 1.13 ms, in
  // the quietest; offset mode 0.51x -> 0.66x), the chunk 3.04 -> 2.76 ms, layout 0 level. Intel processors were
  // not measured then. On an Intel Xeon of family 6 model 167 (side by side in one process, 13 rounds, int8 prefill,
  // on lines / 16 bytes past, ms): layout 3 1.46 / 1.44 against 2.02 / 1.78 (op / copy 0.82x against 0.61-0.65x),
  // layout 2 1.49 / 1.60 against 1.64 / 1.65, layout 0 1.59 / 1.60 against 1.70 / 1.84, offset mode level; the
  // chunk, layout 3, 2.83 / 3.04 against 3.03 / 3.27; decode level. On an Intel Xeon of family 6 model 207 (11
  // rounds, op / copy on lines / 16 bytes past): prefill and the chunk level in every layout (plain stores' time
  // 0.97-1.03x the streamed ones'; layout 3's prefill 0.86x / 0.87x against 0.84x / 0.86x), and the store traffic
  // alone (benchmarks/cpu/bound/scale_rows.cc) has layout 3's scattered half-line scale stores at 1.06-1.08x layout
  // 0's time whichever way they go (2x on the Zen 4). Streamed on every processor running the AVX-512 build; the
  // other builds never stream codes.
  return ChosenKernel() == CpuKernel::kAvx512;
}

bool HeadPrefetchToL2() {
  const int choice = EnvSwitch("KVCACHE_OP_HEAD_PREFETCH", "l2", "l1");
  if (choice >= 0) return choice == 1;
  // Layout 3 keeps a head's slots together, MaxT rows from the next head's: where MaxT is a power of two (the
  // benchmark's 65,536 slots) a slot's head rows share their low twelve bits, and so their set of the first-level
  // cache, whose eight ways (Zen 4's 32 KiB) the eight heads of a streamed pass fill with the rows they ask for
  // kAheadRows (8) rows ahead: a line the core touches meanwhile (the output's, the task's scratch) evicts one before
  // it is read. Asked for into the second level only (prefetcht1), the rows wait there. Measured on an AMD EPYC of
  // family 25 model 17 (Zen 4), one core, float16, paged unless named, side by side in one process (7 rounds, on lines
  // / 16 bytes past), the first level against the second: decode B=64 with 1,024 keys, 8 heads of 128, 0.99x / 1.06x
  // against 1.33x / 1.26x a copy (24.0 -> 17.6 ms); offset 1.01x / 1.00x against 1.36x / 1.36x; 32 heads of 128 (B=16)
  // 1.11x / 1.04x against 1.41x / 1.33x; pages of 16 slots 0.95x / 0.81x against 1.02x / 1.09x, offset 1.02x / 1.00x
  // against 1.40x / 1.37x; in two more runs of pages of 16 (5 rounds, separate processes) 0.86-0.89x / 0.83-0.92x
  // against 1.10-1.12x / 0.98-1.05x; a chunked prefill's chunk (outputs that stay cached, token by token) 0.61x / 0.62x
  // against 0.66x / 0.70x; a prefill 0.56x / 0.49x against 0.56x / 0.61x. Rows asked for 4, 8 and 16 rows ahead with
  // the second level (and 4-24 with the first): within noise of each other (8 stays). This setting itself, a third run
  // (5 rounds): decode 0.99x / 0.98x against 1.32x / 1.30x, pages of 16 0.87x / 0.87x against 1.17x / 1.15x; the AVX2
  // build 0.98x / 0.59x against 1.25x / 0.66x and 0.85x / 0.55x against 1.16x / 0.63x. Int8 rows (codes and scales,
  // four heads a pass) measured mixed: 7 rounds, pages of 16 0.69x / 0.60x against 0.97x / 0.70x, decode 0.93x / 0.86x
  // against 0.92x / 0.79x, offset 0.93x / 0.86x against 0.93x / 0.81x, 32 heads 1.03x / 0.97x against 1.07x / 0.90x; 9
  // rounds, pages of 16 0.70x / 0.63x against 0.76x / 0.64x, pages of 16 offset 1.16x / 0.82x against 0.97x / 0.82x,
  // decode 0.89x / 0.80x against 0.95x / 0.85x: ahead in pages of 16, behind or level elsewhere, so quantized rows keep
  // the first level. Intel processors keep the first level: on an Intel Xeon of family 6 model 207 (11 rounds, on
  // lines / 16 bytes past) the second level took 1.01x / 1.05x the first's time on decode, 1.02x / 1.01x with 32
  // heads of 128, 0.99x / 0.99x in pages of 16 slots: level or slower (its cores' first level has 12 ways of 48
  // KiB, where eight heads do not fill a set: the likely reason, not measured). On an AMD EPYC of family 25 model 1
  // (Zen 3) the first level took 0.95-1.12x the second's time: the second kept. Zen 5 takes it unmeasured (its first
  // level has 12 ways of 48 KiB too: there the reason is weaker).
  return AmdProcessor();
}

bool CallReportWanted() { return EnvSwitch("KVCACHE_OP_CPU_VERBOSE", "1", "0") == 1; }

const char* CpuKernelName() {
  switch (ChosenKernel()) {
    case CpuKernel::kAvx512: return "avx512";
    case CpuKernel::kAvx2: return "avx2";
    default: return "generic";
  }
}

void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for) {
  switch (ChosenKernel()) {
#ifdef KVCACHE_CPU_AVX512
    case CpuKernel::kAvx512: return avx512::ComputeCpu(args, parallel_for);
#endif
#ifdef KVCACHE_CPU_AVX2
    case CpuKernel::kAvx2: return avx2::ComputeCpu(args, parallel_for);
#endif
    default: return generic::ComputeCpu(args, parallel_for);
  }
}

void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for) {
  switch (ChosenKernel()) {
#ifdef KVCACHE_CPU_AVX512
    case CpuKernel::kAvx512: return avx512::MhaComputeCpu(args, parallel_for);
#endif
#ifdef KVCACHE_CPU_AVX2
    case CpuKernel::kAvx2: return avx2::MhaComputeCpu(args, parallel_for);
#endif
    default: return generic::MhaComputeCpu(args, parallel_for);
  }
}

namespace {

void MhcaComputeChosen(const MhcaArgs& args, const ParallelFor& parallel_for) {
  switch (ChosenKernel()) {
#ifdef KVCACHE_CPU_AVX512
    case CpuKernel::kAvx512: return avx512::MhcaComputeCpu(args, parallel_for);
#endif
#ifdef KVCACHE_CPU_AVX2
    case CpuKernel::kAvx2: return avx2::MhcaComputeCpu(args, parallel_for);
#endif
    default: return generic::MhcaComputeCpu(args, parallel_for);
  }
}

}  // namespace

void MhcaComputeCpu(const MhcaArgs& args, const ParallelFor& parallel_for) {
  // The attention's working memory grows with the keys it reads (a page table may name one shared page any number
  // of times), and is taken after the stores: the rows they overwrite are saved first and put back if the call
  // fails after them, so a failed call leaves the cache and scale as they were.
  const Attrs& a = args.attrs->cache;
  const CallPlan& p = args.plan->cache;
  const StoredRowsBackup backup = [&] {
    try {
      return StoredRowsBackup(a, p, CacheElemType(a, args.t1), args.scale_type, args.cache, args.scale);
    } catch (const std::bad_alloc&) {  // before any store
      Fail("MultiHeadCacheAttention: out of memory for saving the cache rows its ", p.tokens,
           " stored tokens overwrite (kept until the call succeeds); nothing was written");
    }
  }();
  try {
    MhcaComputeChosen(args, parallel_for);
  } catch (const std::bad_alloc&) {
    backup.Restore();
    Fail("MultiHeadCacheAttention: out of memory for the attention's working memory (", p.kv_tokens, " keys over ",
         p.batch, " sequences); the cache and scale are unchanged");
  } catch (...) {
    backup.Restore();
    throw;
  }
}

}  // namespace kvcache
