// Test-only host runner of the attention CUDA kernels (MultiHeadAttention, MultiHeadCacheAttention): validates and
// plans a call exactly as the GPU path does (cpu/*_validate.h, cuda/attention_params.h), then runs every block of
// the tile launch and of the merge launch through the kernels' own work (cuda/attention_work.h), each block's team
// of threads phase by phase: team.Each runs every thread's part of a phase, team.Sync ends the phase. Every access
// goes through a checking memory policy, and a run is flagged when
//   (a) an access falls outside its buffer, or is misaligned for its size (both fault on a GPU);
//   (b) two threads of one launch write the same byte of global memory, or two threads of a block write the same
//       shared byte within one phase (races on the GPU);
//   (c) a thread reads a byte another thread writes in the same launch (global) or phase (shared): the reader
//       could see either value on the GPU — a missing barrier;
//   (d) a thread reads shared memory no thread of its block has written (garbage on the GPU);
//   (e) a block-wide operation (a barrier, a copy group's commit or wait, a shuffle, a warp's product or ldmatrix,
//       team.Each itself) is called inside team.Each: on the GPU one thread's part of a phase reaching it is a
//       divergent barrier or shuffle, and here the runner would end a phase in the middle of the threads' loop.
// MultiHeadCacheAttention's stores are KeyValueCache's store kernel, checked by its own host runner; here they run
// unchecked before the attention, so the attention reads the cache the GPU would.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "attention_c_args.h"
#include "attention_decode.h"
#include "attention_decode_staged.h"
#include "attention_mma.h"
#include "attention_mma_regs.h"
#include "attention_params.h"
#include "attention_work.h"
#include "c_tensors.h"
#include "kv_cache_work.h"
#include "kv_cuda_params.h"
#include "kvcache_op.h"
#include "mhca_validate.h"

extern "C" {
struct AttnHostRunOptions {
  int64_t min_blocks, min_split_keys;  // the planner's policy (the GPU reads min_blocks off the device)
  int64_t skip_sync;                   // 1: team.Sync() does not end a phase (shows (c) is caught)
  int64_t buffer_bytes[kvcache::cuda::kABufCount];  // >= 0: the size the checks assume (shows (a) is caught)
  int64_t tile_kernel_only;                          // 1: every tile to the tile kernel (no decode, no tensor-core)
  int64_t mma_decode;                                // 1: sequences of one token to the tensor-core kernel too
  int64_t mma_form;                                  // the tensor-core kernel's form (1 or 2; 0: 1)
  int64_t decode_form;  // 2: the staged decode kernel where the rows fit it, 3: its second form (heads in registers)
  int64_t short_wait;  // > 0: team.WaitSync<N> leaves N + short_wait groups of copies in flight (shows it is caught)
};

struct AttnHostRunReport {
  int64_t launches, blocks, threads, tiles, merges, split_tiles;
  int64_t out_of_bounds, misaligned, write_write, read_write, uninitialized;
  int64_t decode_tiles, mma_tiles;
  int64_t mma_form;     // the tensor-core kernel's form that ran (0: no tensor-core tiles)
  int64_t decode_form;  // the decode kernel's form that ran (0: no decode tiles)
  int64_t divergent;    // block-wide operations called inside team.Each, (e)
  int64_t index_words;  // int64 words of the attention's index inputs, as copied to the device
  int64_t store_index_words;  // MultiHeadCacheAttention: those of its stores' index inputs
};
}  // extern "C"

namespace kvcache {
namespace {

using cuda::ABuf;

constexpr int64_t kNobody = -1, kMany = -2;
// Every block kernel's shared memory fits this many words (one host array serves them all).
constexpr int64_t kSharedWordsMost =
    std::max({cuda::kSharedWords, cuda::kMmaSharedWords, cuda::kMmaRegSharedWords, cuda::kStagedSharedWords});

const char* BufName(int b) {
  static const char* const names[] = {"query", "key", "value", "cache", "scale", "attn_mask", "output",
                                      "index words", "tile words", "partials", "shared memory"};
  return names[b];
}

struct Shadow {
  int64_t writer = kNobody, reader = kNobody;
  bool written = false;  // shared memory: written by some thread of the block
};

struct CheckingMem {
  char* base[cuda::kABufCount] = {};
  int64_t bytes[cuda::kABufCount] = {};
  std::vector<Shadow> shadow[cuda::kABufCount];  // per byte, for the buffers written by the kernels
  std::vector<int32_t> in_flight;                // per shared byte: the asynchronous copies to it not yet made
  int64_t short_wait = 0;                        // AttnHostRunOptions::short_wait
  AttnHostRunReport* report;
  std::vector<std::string> first;
  std::string where;    // the launch and block, for messages
  int64_t thread = -1;  // -1: a block-uniform read outside team.Each (not traced)
  int64_t block_id = 0;

  void Note(int64_t& counter, const std::string& what) {
    ++counter;
    if (first.size() < 6) first.push_back(where + ": " + what);
  }
  static bool Traced(ABuf b) { return b == cuda::kAOut || b == cuda::kAPartials || b == cuda::kAShared; }
  int64_t Who() const { return thread < 0 ? kNobody : block_id * cuda::kAttnThreads + thread; }

  bool Reach(ABuf buf, int64_t offset, int64_t size, const char* verb) {
    if (base[buf] == nullptr || offset < 0 || offset > bytes[buf] - size) {
      std::ostringstream s;
      s << "thread " << thread << " " << verb << " bytes [" << offset << ", " << offset + size << ") of "
        << BufName(buf) << ", which has " << bytes[buf] << " bytes";
      Note(report->out_of_bounds, s.str());
      return false;
    }
    if (reinterpret_cast<uintptr_t>(base[buf] + offset) % size != 0) {
      std::ostringstream s;
      s << "thread " << thread << " " << verb << " " << size << " bytes at offset " << offset << " of " << BufName(buf)
        << ", not " << size << "-byte aligned";
      Note(report->misaligned, s.str());
      return false;
    }
    return true;
  }

  template <class T>
  T Load(ABuf buf, int64_t offset) {
    T value{};
    if (!Reach(buf, offset, sizeof(T), "reads")) return value;
    if (Traced(buf) && thread >= 0) {
      for (size_t i = 0; i < sizeof(T); ++i) {
        Shadow& s = shadow[buf][offset + i];
        if (buf == cuda::kAShared && in_flight[static_cast<size_t>(offset) + i] > 0) {
          Note(report->read_write, "thread " + std::to_string(thread) + " reads shared byte " +
                                       std::to_string(offset + i) + ", which an asynchronous copy in flight writes");
        }
        if (buf == cuda::kAShared && !s.written) {
          Note(report->uninitialized, "thread " + std::to_string(thread) + " reads shared byte " +
                                          std::to_string(offset + i) + ", which no thread of the block wrote");
          s.written = true;  // one report per byte
        }
        if (s.writer != kNobody && s.writer != Who()) {
          Note(report->read_write, "thread " + std::to_string(thread) + " reads byte " + std::to_string(offset + i) +
                                       " of " + BufName(buf) + ", which another thread writes in the same " +
                                       (buf == cuda::kAShared ? "phase" : "launch"));
          s.writer = kMany;
        }
        s.reader = s.reader == kNobody || s.reader == Who() ? Who() : kMany;
      }
    }
    std::memcpy(&value, base[buf] + offset, sizeof(T));
    return value;
  }

  template <class T>
  void Store(ABuf buf, int64_t offset, T value) {
    if (!Reach(buf, offset, sizeof(T), "writes")) return;
    if (!Traced(buf) || thread < 0) {
      Note(report->write_write, std::string("a write to ") + BufName(buf) + " outside the traced buffers or threads");
      return;
    }
    for (size_t i = 0; i < sizeof(T); ++i) {
      Shadow& s = shadow[buf][offset + i];
      if (buf == cuda::kAShared && in_flight[static_cast<size_t>(offset) + i] > 0)
        Note(report->write_write, "thread " + std::to_string(thread) + " writes shared byte " +
                                      std::to_string(offset + i) + ", which an asynchronous copy in flight writes");
      if (s.writer != kNobody && s.writer != Who())
        Note(report->write_write, "thread " + std::to_string(thread) + " writes byte " + std::to_string(offset + i) +
                                      " of " + BufName(buf) + ", also written by another thread");
      if (s.reader != kNobody && s.reader != Who())
        Note(report->read_write, "thread " + std::to_string(thread) + " writes byte " + std::to_string(offset + i) +
                                     " of " + BufName(buf) + ", which another thread reads in the same " +
                                     (buf == cuda::kAShared ? "phase" : "launch"));
      s.writer = Who();
      s.written = true;
    }
    std::memcpy(base[buf] + offset, &value, sizeof(T));
  }

  // A barrier: shared bytes keep whether they were written, nothing else.
  void EndPhase() {
    for (Shadow& s : shadow[cuda::kAShared]) s = Shadow{kNobody, kNobody, s.written};
  }
  void StartBlock(int64_t id) {
    block_id = id;
    for (Shadow& s : shadow[cuda::kAShared]) s = Shadow{};
    std::fill_n(reinterpret_cast<float*>(base[cuda::kAShared]), kSharedWordsMost, std::nanf(""));  // poison
  }
  void StartLaunch(const char* name) {
    where = name;
    for (ABuf b : {cuda::kAOut, cuda::kAPartials})
      for (Shadow& s : shadow[b]) s = Shadow{};
  }
};

// A block of `Threads` threads, each with its registers `State`, run phase by phase.
template <class State, int64_t Threads>
struct HostTeam {
  CheckingMem& mem;
  bool skip_sync;
  std::vector<State> state = std::vector<State>(Threads);
  // (e): a block-wide operation must be reached by the whole block at once, outside any thread's part of a phase.
  void Uniform(const char* op) {
    if (mem.thread >= 0)
      mem.Note(mem.report->divergent, "thread " + std::to_string(mem.thread) + " calls team." + op +
                                          " inside team.Each (a block-wide operation in one thread's part of a phase)");
  }
  template <class F>
  void Each(F&& f) {
    Uniform("Each");
    for (int64_t t = 0; t < Threads; ++t) {
      mem.thread = t;
      f(t, state[static_cast<size_t>(t)]);
    }
    mem.thread = -1;
  }
  void Sync() {
    Uniform("Sync");
    Barrier();
  }
  void Barrier() {
    if (!skip_sync) mem.EndPhase();
  }
  // Asynchronous copies (the GPU's cp.async): a copy is checked where it is issued (both ends in bounds and 16-byte
  // aligned, no other copy in flight to its bytes, no other thread writing or reading them in this phase) and made
  // at the WaitSync that covers its group, as the issuing thread's write; until then any access to its bytes is a
  // race.
  struct PendingCopy {
    int64_t thread, shared_byte;
    ABuf buf;
    int64_t byte;
  };
  std::vector<PendingCopy> open;                 // issued, not yet committed
  std::vector<std::vector<PendingCopy>> groups;  // committed, oldest first
  void CopyAsync16(CheckingMem& m, int64_t shared_byte, ABuf buf, int64_t byte) {
    if (!m.Reach(buf, byte, 16, "copies from") || !m.Reach(cuda::kAShared, shared_byte, 16, "copies to")) return;
    for (int64_t i = 0; i < 16; ++i) {
      const size_t at = static_cast<size_t>(shared_byte + i);
      const Shadow& s = m.shadow[cuda::kAShared][at];
      if (m.in_flight[at] > 0)
        m.Note(m.report->write_write, "thread " + std::to_string(m.thread) + " copies to shared byte " +
                                          std::to_string(shared_byte + i) + ", which another copy in flight writes");
      else if (s.writer != kNobody && s.writer != m.Who())
        m.Note(m.report->write_write, "thread " + std::to_string(m.thread) + " copies to shared byte " +
                                          std::to_string(shared_byte + i) +
                                          ", which another thread writes in this phase");
      else if (s.reader != kNobody && s.reader != m.Who())
        m.Note(m.report->read_write, "thread " + std::to_string(m.thread) + " copies to shared byte " +
                                         std::to_string(shared_byte + i) +
                                         ", which another thread reads in this phase");
      ++m.in_flight[at];
    }
    open.push_back(PendingCopy{m.thread, shared_byte, buf, byte});
  }
  void Commit() {
    Uniform("Commit");
    groups.push_back(std::move(open));
    open.clear();
  }
  template <int N>
  void WaitSync() {
    Uniform("WaitSync");
    while (groups.size() > static_cast<size_t>(N + mem.short_wait)) {
      for (const PendingCopy& c : groups.front()) {
        mem.thread = c.thread;
        for (int64_t i = 0; i < 16; ++i) --mem.in_flight[static_cast<size_t>(c.shared_byte + i)];
        mem.Store(cuda::kAShared, c.shared_byte, mem.Load<cuda::Vec16>(c.buf, c.byte));
      }
      mem.thread = -1;
      groups.erase(groups.begin());
    }
    Barrier();
  }
  // A block that ends with copies in flight: reported, and dropped (its shared memory is gone). Without any, every
  // count of in_flight is back at 0 already.
  void EndBlock() {
    size_t left = open.size();
    for (const auto& g : groups) left += g.size();
    if (left == 0) return;
    mem.Note(mem.report->write_write, std::to_string(left) + " asynchronous copies still in flight at the block's end");
    open.clear();
    groups.clear();
    std::fill(mem.in_flight.begin(), mem.in_flight.end(), 0);
  }
  // The GPU's __shfl_xor_sync exchange: for each mask, every thread combines its value with the value thread
  // (t ^ mask) held before the exchange. A mask must stay within a warp.
  template <class Get, class Op>
  void Butterfly(int64_t lo, int64_t hi, Get&& get, Op&& op) {
    Uniform("Butterfly");
    for (int64_t mask = lo; mask < hi; mask *= 2) {
      if (mask >= cuda::kWarp) {
        mem.Note(mem.report->out_of_bounds, "a butterfly mask of " + std::to_string(mask) + " leaves the warp");
        return;
      }
      std::vector<State> before = state;  // every thread reads its partner's value from before the exchange
      for (int64_t t = 0; t < Threads; ++t) {
        auto& mine = get(state[static_cast<size_t>(t)]);
        const auto& own = get(before[static_cast<size_t>(t)]);
        const auto& other = get(before[static_cast<size_t>(t ^ mask)]);
        for (size_t i = 0; i < sizeof(mine) / sizeof(mine[0]); ++i) mine[i] = op(own[i], other[i]);
      }
    }
  }
  // __syncthreads_or: the barrier, and whether get(state) is non-zero in any thread.
  template <class Get>
  bool SyncOr(Get&& get) {
    Uniform("SyncOr");
    Barrier();
    bool any = false;
    for (State& s : state) any = any || get(s) != 0;
    return any;
  }
  // Each warp's m16n8k16 product on its lanes' fragment registers (attention_mma_regs.h), in the layout of the
  // GPU's mma.sync: lane l (group g = l / 4, pair c = 2 (l % 4)) holds A rows g and g + 8, columns c, c + 1, c + 8,
  // c + 9 (words: (g, c), (g + 8, c), (g, c + 8), (g + 8, c + 8)); B (k x n) rows c, c + 1 and c + 8, c + 9 of
  // column g; C rows g (elements 0, 1) and g + 8 (2, 3), columns c, c + 1. Sums in float, in k order.
  template <class T1, class GetA, class GetB, class GetC>
  void Mma(GetA&& get_a, GetB&& get_b, GetC&& get_c) {
    Uniform("Mma");
    auto lo = [](uint32_t w) { return T1::ToFloat(static_cast<uint16_t>(w & 0xffffu)); };
    auto hi = [](uint32_t w) { return T1::ToFloat(static_cast<uint16_t>(w >> 16)); };
    for (int64_t w = 0; w < Threads / cuda::kWarp; ++w) {
      float a[16][16], b[16][8], c[16][8];
      for (int64_t l = 0; l < cuda::kWarp; ++l) {
        State& st = state[static_cast<size_t>(w * cuda::kWarp + l)];
        const int g = static_cast<int>(l / 4), k = static_cast<int>(2 * (l % 4));
        const auto& ra = get_a(st);
        const auto& rb = get_b(st);
        const auto& rc = get_c(st);
        const int arow[4] = {g, g + 8, g, g + 8}, acol[4] = {k, k, k + 8, k + 8};
        for (int r = 0; r < 4; ++r) {
          a[arow[r]][acol[r]] = lo(ra[r]);
          a[arow[r]][acol[r] + 1] = hi(ra[r]);
        }
        for (int r = 0; r < 2; ++r) {
          b[k + 8 * r][g] = lo(rb[r]);
          b[k + 8 * r + 1][g] = hi(rb[r]);
        }
        for (int e = 0; e < 4; ++e) c[g + 8 * (e / 2)][k + e % 2] = rc[e];
      }
      for (int r = 0; r < 16; ++r)
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 16; ++i) c[r][j] += a[r][i] * b[i][j];
      for (int64_t l = 0; l < cuda::kWarp; ++l) {
        auto& rc = get_c(state[static_cast<size_t>(w * cuda::kWarp + l)]);
        const int g = static_cast<int>(l / 4), k = static_cast<int>(2 * (l % 4));
        for (int e = 0; e < 4; ++e) rc[e] = c[g + 8 * (e / 2)][k + e % 2];
      }
    }
  }
  // Each warp's ldmatrix (the GPU's: attention_kernels.cuh's DeviceTeam::LoadMatrix): row r of matrix m is read, as
  // lane 8 m + r's 16-byte load of the shared byte it gives (checked: in bounds, aligned, written, no race), and
  // lane l receives row l / 4, columns 2 (l % 4), + 1 of each matrix (with Trans: column l / 4, rows 2 (l % 4), + 1).
  template <int Count, bool Trans, class RowByte, class GetR>
  void LoadMatrix(CheckingMem& m, RowByte&& row_byte, GetR&& get_r) {
    static_assert(Count == 2 || Count == 4, "ldmatrix takes 2 or 4 matrices here");
    Uniform("LoadMatrix");
    for (int64_t w = 0; w < Threads / cuda::kWarp; ++w) {
      uint16_t e[Count][8][8];
      for (int mat = 0; mat < Count; ++mat)
        for (int r = 0; r < 8; ++r) {
          const int64_t t = w * cuda::kWarp + 8 * mat + r;
          m.thread = t;
          const cuda::Vec16 v = m.Load<cuda::Vec16>(cuda::kAShared, row_byte(t, state[static_cast<size_t>(t)]));
          for (int i = 0; i < 4; ++i) {
            e[mat][r][2 * i] = static_cast<uint16_t>(v.w[i] & 0xffffu);
            e[mat][r][2 * i + 1] = static_cast<uint16_t>(v.w[i] >> 16);
          }
        }
      for (int64_t l = 0; l < cuda::kWarp; ++l) {
        auto& r = get_r(state[static_cast<size_t>(w * cuda::kWarp + l)]);
        const int row = static_cast<int>(l / 4), col = static_cast<int>(2 * (l % 4));
        for (int mat = 0; mat < Count; ++mat) {
          const uint16_t lo = Trans ? e[mat][col][row] : e[mat][row][col];
          const uint16_t hi = Trans ? e[mat][col + 1][row] : e[mat][row][col + 1];
          r[mat] = uint32_t(lo) | uint32_t(hi) << 16;
        }
      }
    }
    m.thread = -1;
  }
  // Each warp's matrix product (attention_mma.h's WarpProduct), in float over the checked shared memory: the warp's
  // accesses are its lane 0's. Each element of A and B is read once, as the fragments load them.
  template <class T1, bool BCols, bool Accumulate>
  void MatMul(CheckingMem&, const cuda::WarpProduct& m) {
    using T = typename T1::Storage;
    Uniform("MatMul");
    const int64_t F = cuda::kMmaFrag;
    if (m.n % F != 0 || m.k % F != 0 || m.k > cuda::kMmaMaxProductDepth) {
      mem.Note(mem.report->out_of_bounds, "a product of " + std::to_string(m.n) + " columns and depth " +
                                              std::to_string(m.k) + " the fragments cannot take");
      return;
    }
    // WMMA's own rules: every fragment starts 32-byte aligned (offsets from the 128-byte aligned shared array; a
    // fragment's columns step by 16 elements), and strides are multiples of 16 bytes.
    for (int64_t w = 0; w < Threads / cuda::kWarp; ++w)
      for (const int64_t offset : {m.a + w * m.a_warp, m.b, m.c + w * m.c_warp})
        if (offset % 32 != 0)
          mem.Note(mem.report->misaligned, "a fragment at shared byte " + std::to_string(offset) + ", not 32-byte aligned");
    if (m.lda % 8 != 0 || m.ldb % 8 != 0 || m.ldc % 4 != 0)
      mem.Note(mem.report->misaligned, "fragment strides " + std::to_string(m.lda) + ", " + std::to_string(m.ldb) +
                                           ", " + std::to_string(m.ldc) + " not multiples of 16 bytes");
    auto elem = [&](int64_t byte) { return T1::ToFloat(mem.Load<T>(cuda::kAShared, byte)); };
    for (int64_t w = 0; w < Threads / cuda::kWarp; ++w) {
      mem.thread = w * cuda::kWarp;
      std::vector<float> a(static_cast<size_t>(F * m.k)), b(static_cast<size_t>(m.k * m.n));
      for (int64_t r = 0; r < F; ++r)
        for (int64_t i = 0; i < m.k; ++i) a[size_t(r * m.k + i)] = elem(m.a + w * m.a_warp + (r * m.lda + i) * 2);
      for (int64_t i = 0; i < m.k; ++i)
        for (int64_t j = 0; j < m.n; ++j)
          b[size_t(i * m.n + j)] = elem(m.b + (BCols ? j * m.ldb + i : i * m.ldb + j) * 2);
      for (int64_t r = 0; r < F; ++r)
        for (int64_t j = 0; j < m.n; ++j) {
          const int64_t at = m.c + w * m.c_warp + (r * m.ldc + j) * 4;
          float acc = Accumulate ? mem.Load<float>(cuda::kAShared, at) : 0.0f;
          for (int64_t i = 0; i < m.k; ++i) acc += a[size_t(r * m.k + i)] * b[size_t(i * m.n + j)];
          mem.Store<float>(cuda::kAShared, at, acc);
        }
    }
    mem.thread = -1;
  }
};

// KeyValueCache's memory policy, unchecked (its own host runner checks the stores).
struct PlainMem {
  const cuda::Params& p;
  template <class T>
  T Load(cuda::Buf buf, int64_t offset) const {
    T v;
    std::memcpy(&v, static_cast<const char*>(p.ptr[buf]) + offset, sizeof(T));
    return v;
  }
  template <class T>
  void Store(cuda::Buf buf, int64_t offset, T v) const {
    std::memcpy(static_cast<char*>(p.ptr[buf]) + offset, &v, sizeof(T));
  }
};

struct StoreRunner {
  const cuda::Params& p;
  template <class T1, class T3, int QBits>
  int Run() const {
    PlainMem mem{p};
    const cuda::Grid g = cuda::StoreGrid(p, QBits);
    if (g.Empty()) return 0;
    for (int64_t by = 0; by < g.blocks_y; ++by)
      for (int64_t bx = 0; bx < g.blocks_x; ++bx)
        for (int64_t tx = 0; tx < g.threads; ++tx)
          cuda::StoreThread<T1, T3, QBits>(p, mem, g.unit, bx, by, tx, g.threads);
    return 0;
  }
};

// Every block of one launch of a block-cooperative kernel: work(team, block) with a fresh shared memory each, of
// the kernel's own size (`shared_words`: an access past it is flagged, as past any buffer).
template <class State, int64_t Threads, class Work>
void RunBlocks(CheckingMem& mem, bool skip_sync, const char* launch, int64_t blocks, int64_t shared_words,
               Work&& work) {
  HostTeam<State, Threads> team{mem, skip_sync, std::vector<State>(Threads), {}, {}};
  const int64_t shared_bytes = mem.bytes[cuda::kAShared];
  mem.bytes[cuda::kAShared] = std::min(shared_bytes, shared_words * 4);
  mem.StartLaunch(launch);
  for (int64_t block = 0; block < blocks; ++block) {
    mem.StartBlock(block);
    mem.where = std::string(launch) + ", block " + std::to_string(block);
    work(team, block);
    team.EndBlock();
  }
  mem.bytes[cuda::kAShared] = shared_bytes;
}

// The tile launch, the decode launch, then the merge launch of a planned call.
template <class T1, class Rows>
void RunLaunches(const cuda::AttnParams& p, CheckingMem& mem, bool skip_sync) {
  RunBlocks<cuda::AttnThread, cuda::kAttnThreads>(mem, skip_sync, "tile launch", p.tiles, cuda::kSharedWords,
                                                  [&](auto& team, int64_t b) {
                                                    cuda::AttentionTile<T1>(p, Rows{}, mem, team, b);
                                                  });
  if (p.decode_form == 2 || p.decode_form == 3) {
    if constexpr (cuda::kStagedRows<T1, Rows>) {
      if (p.decode_tiles > 0) mem.report->decode_form = p.decode_form;
      if (p.decode_form == 3)
        RunBlocks<cuda::StagedHeadsThread, cuda::kStagedThreads>(
            mem, skip_sync, "staged decode launch, heads in registers", p.decode_tiles, cuda::kStagedSharedWords,
            [&](auto& team, int64_t b) { cuda::StagedHeadsTile<T1>(p, Rows{}, mem, team, b); });
      else
        RunBlocks<cuda::StagedThread, cuda::kStagedThreads>(mem, skip_sync, "staged decode launch", p.decode_tiles,
                                                            cuda::kStagedSharedWords, [&](auto& team, int64_t b) {
                                                              cuda::StagedDecodeTile<T1>(p, Rows{}, mem, team, b);
                                                            });
    } else if (p.decode_tiles > 0) {  // the library builds the staged form for these rows only
      mem.Note(mem.report->out_of_bounds, "the staged decode kernel planned for rows it is not built for");
    }
  } else {
    if (p.decode_tiles > 0) mem.report->decode_form = 1;
    RunBlocks<cuda::DecodeThread, cuda::kDecodeThreads>(mem, skip_sync, "decode launch", p.decode_tiles,
                                                        cuda::kDecodeSharedWords, [&](auto& team, int64_t b) {
                                                          cuda::DecodeTile<T1>(p, Rows{}, mem, team, b);
                                                        });
  }
  if constexpr (sizeof(typename T1::Storage) == 2) {
    if (p.mma_tiles > 0) mem.report->mma_form = p.mma_form == 2 ? 2 : 1;
    if (p.mma_tiles > 0 && p.mma_form == 2 && !Rows::kStoredAsT1)  // the library builds form 2 for these rows only
      mem.Note(mem.report->out_of_bounds, "the second tensor-core form planned for quantized rows");
    else if (p.mma_form == 2)
      RunBlocks<cuda::MmaRegThread, cuda::kMmaThreads>(mem, skip_sync, "tensor-core launch", p.mma_tiles,
                                                       cuda::kMmaRegSharedWords, [&](auto& team, int64_t b) {
                                                         cuda::MmaRegTile<T1>(p, Rows{}, mem, team, b);
                                                       });
    else
      RunBlocks<cuda::MmaThread, cuda::kMmaThreads>(mem, skip_sync, "tensor-core launch", p.mma_tiles,
                                                    cuda::kMmaSharedWords, [&](auto& team, int64_t b) {
                                                      cuda::MmaTile<T1>(p, Rows{}, mem, team, b);
                                                    });
  } else if (p.mma_tiles > 0) {
    mem.Note(mem.report->out_of_bounds, "tensor-core tiles planned for a float32 call");
  }
  mem.StartLaunch("merge launch");
  for (int64_t m = 0; m < p.merges; ++m) {
    mem.block_id = m;
    mem.where = "merge launch, block " + std::to_string(m);
    for (int64_t t = 0; t < cuda::kAttnThreads; ++t) {
      mem.thread = t;
      cuda::MergeThread<T1>(p, mem, m, t);
    }
    mem.thread = -1;
  }
  mem.report->launches += (p.tiles > 0) + (p.decode_tiles > 0) + (p.mma_tiles > 0) + (p.merges > 0);
  mem.report->blocks += p.tiles + p.decode_tiles + p.mma_tiles + p.merges;
  mem.report->threads += (p.tiles + p.merges) * cuda::kAttnThreads + p.decode_tiles * cuda::kDecodeThreads +
                         p.mma_tiles * cuda::kMmaThreads;
}

template <class T1>
void RunCache(const cuda::AttnParams& p, CheckingMem& mem, int32_t scale_type, int quant_bit, bool skip_sync) {
  const bool f16 = scale_type == int32_t(Elem::kFloat16);
  switch (quant_bit) {
    case 0: return RunLaunches<T1, cuda::CacheRows<T1, F32, 0>>(p, mem, skip_sync);
    case 8:
      return f16 ? RunLaunches<T1, cuda::CacheRows<T1, F16, 8>>(p, mem, skip_sync)
                 : RunLaunches<T1, cuda::CacheRows<T1, F32, 8>>(p, mem, skip_sync);
    default:
      return f16 ? RunLaunches<T1, cuda::CacheRows<T1, F16, 4>>(p, mem, skip_sync)
                 : RunLaunches<T1, cuda::CacheRows<T1, F32, 4>>(p, mem, skip_sync);
  }
}

void RunAll(const cuda::AttnParams& p, CheckingMem& mem, int32_t t1, int32_t scale_type, int quant_bit, bool cache,
            bool skip_sync) {
  switch (static_cast<Elem>(t1)) {
    case Elem::kFloat32:
      return cache ? RunCache<F32>(p, mem, scale_type, quant_bit, skip_sync)
                   : RunLaunches<F32, cuda::PackedRows<F32>>(p, mem, skip_sync);
    case Elem::kFloat16:
      return cache ? RunCache<F16>(p, mem, scale_type, quant_bit, skip_sync)
                   : RunLaunches<F16, cuda::PackedRows<F16>>(p, mem, skip_sync);
    default:
      return cache ? RunCache<BF16>(p, mem, scale_type, quant_bit, skip_sync)
                   : RunLaunches<BF16, cuda::PackedRows<BF16>>(p, mem, skip_sync);
  }
}

int64_t BytesOf(const TensorArg& t) { return t.present ? TensorBytes(t.type, t.shape) : 0; }

// MultiHeadCacheAttention's stores (KeyValueCache's store kernel, unchecked), run as the CUDA op runs them: their
// index inputs after the attention's words (cuda::AppendStoreIndices), before the attention's launches.
struct StoresCall {
  const Attrs& attrs;
  const CallPlan& plan;
  cuda::DeviceTensors rows;
  int32_t t1, scale_type;
  int quant_bit;
};

// Plans, then runs the stores (`stores`, if any) and the launches through the checking memory. The output is written
// in place.
int32_t RunPlanned(const MhaAttrs& a, const MhaPlan& plan, const cuda::CacheSide* cache, const TensorArg* in,
                   const cuda::AttnTensors& t, int32_t scale_type, int quant_bit, const AttnHostRunOptions& o,
                   AttnHostRunReport* report, std::string* faults, const StoresCall* stores = nullptr) {
  cuda::TilePolicy policy;
  if (o.min_blocks > 0) policy.min_blocks = policy.min_decode_blocks = o.min_blocks;
  if (o.min_split_keys > 0) policy.min_split_keys = policy.min_decode_split_keys = o.min_split_keys;
  policy.decode_kernel = o.tile_kernel_only == 0;
  policy.mma_kernel = o.tile_kernel_only == 0 && cuda::MmaRowsFit(in[0].type, t, cache);
  policy.mma_decode = o.mma_decode != 0;
  policy.mma_form = cuda::MmaFormFor(o.mma_form == 2 ? 2 : 1, cache);
  const bool staged =
      (o.decode_form == 2 || o.decode_form == 3) && cuda::StagedRowsFit(in[0].type, scale_type, t, cache);
  policy.decode_form = staged ? static_cast<int>(o.decode_form) : 1;
  cuda::AttnLaunchPlan launch = cuda::PlanAttention(a, plan, cache, policy);
  const auto attention_words = static_cast<int64_t>(launch.words.size());  // the stores' follow
  if (const int64_t at = stores ? cuda::AppendStoreIndices(stores->plan, &launch) : -1; at >= 0) {
    report->store_index_words = static_cast<int64_t>(launch.words.size()) - at;
    const cuda::Params sp = cuda::MakeParams(stores->attrs, stores->plan, launch.words.data() + at, stores->rows);
    cuda::DispatchTypes(stores->t1, stores->scale_type, stores->quant_bit, StoreRunner{sp});
  }
  std::vector<float> partials(static_cast<size_t>(launch.records * (a.head_dim + 2)), std::nanf(""));
  std::vector<float> shared(static_cast<size_t>(kSharedWordsMost));
  const cuda::AttnParams p = cuda::MakeAttnParams(a, plan, cache, launch, t, launch.words.data(), partials.data());
  const int64_t index_bytes = launch.index_words * 8, work_bytes = attention_words * 8 - index_bytes;
  CheckingMem mem;
  mem.report = report;
  const int64_t sizes[cuda::kABufCount] = {
      BytesOf(in[0]), cache ? 0 : BytesOf(in[1]), cache ? 0 : BytesOf(in[2]), 0, 0, 0, BytesOf(in[0]),
      index_bytes, work_bytes, int64_t(partials.size() * 4), kSharedWordsMost * 4};
  for (int b = 0; b < cuda::kABufCount; ++b) {
    mem.base[b] = static_cast<char*>(p.ptr[b]);
    mem.bytes[b] = sizes[b];
  }
  mem.base[cuda::kAShared] = reinterpret_cast<char*>(shared.data());
  for (ABuf b : {cuda::kAOut, cuda::kAPartials, cuda::kAShared})
    mem.shadow[b].resize(static_cast<size_t>(mem.bytes[b]));
  mem.in_flight.assign(static_cast<size_t>(mem.bytes[cuda::kAShared]), 0);
  mem.short_wait = o.short_wait;
  if (cache) {
    mem.bytes[cuda::kACache] = BytesOf(in[kMhcaCacheInput]);
    mem.bytes[cuda::kAScale] = BytesOf(in[kMhcaScaleInput]);
    mem.bytes[cuda::kAMask] = BytesOf(in[kMhcaMaskInput]);
  } else {
    mem.bytes[cuda::kAMask] = BytesOf(in[kMhaMaskInput]);
  }
  for (int b = 0; b < cuda::kABufCount; ++b)
    if (o.buffer_bytes[b] >= 0) mem.bytes[b] = std::min(mem.bytes[b], o.buffer_bytes[b]);
  report->tiles = launch.tiles;
  report->index_words = launch.index_words;
  report->decode_tiles = launch.decode_tiles;
  report->mma_tiles = launch.mma_tiles;
  report->merges = launch.merges;
  for (int64_t i = 0; i < launch.tiles + launch.decode_tiles + launch.mma_tiles; ++i)
    report->split_tiles += launch.words[size_t(launch.index_words + i * cuda::kTileWords + 7)] >= 0;
  RunAll(p, mem, in[0].type, scale_type, quant_bit, cache != nullptr, o.skip_sync != 0);
  const int64_t counted = report->out_of_bounds + report->misaligned + report->write_write + report->read_write +
                          report->uninitialized + report->divergent;
  if (counted == 0) return 0;
  for (const std::string& f : mem.first) *faults += f + "\n";
  return 4;
}

// An entry's frame: the report cleared, a validation error's code and message, else the run's result with the
// first faults it found as the message (written after CatchAll, which writes its own message, empty on success).
template <class Body>
int32_t HostEntry(AttnHostRunReport* report, char* message, size_t message_size, Body&& body) {
  *report = AttnHostRunReport{};
  int32_t result = 0;
  std::string faults;
  const int32_t code = CatchAll([&] { result = body(&faults); }, message, message_size);
  if (code != KVCACHE_OP_OK) return code;
  WriteMessage(faults, message, message_size);
  return result;
}

// The runner's own check (e), tested: block-wide operation `op` (1 Each, 2 Sync, 3 Commit, 4 WaitSync, 5 Butterfly,
// 6 SyncOr, 7 Mma, 8 LoadMatrix, 9 MatMul) called inside team.Each, or with op 0 every one of them called as the
// kernels call them, outside it. Returns how many calls (e) flagged.
struct MisuseState {
  uint32_t a[4], b[2];
  float c[4], v[1];
};
int64_t TeamMisuse(int64_t op) {
  AttnHostRunReport report{};
  CheckingMem mem;
  mem.report = &report;
  std::vector<float> shared(static_cast<size_t>(kSharedWordsMost), 0.0f);
  mem.base[cuda::kAShared] = reinterpret_cast<char*>(shared.data());
  mem.bytes[cuda::kAShared] = kSharedWordsMost * 4;
  mem.shadow[cuda::kAShared].assign(shared.size() * 4, Shadow{kNobody, kNobody, true});
  mem.in_flight.assign(shared.size() * 4, 0);
  HostTeam<MisuseState, cuda::kAttnThreads> team{mem, false, std::vector<MisuseState>(cuda::kAttnThreads), {}, {}};
  auto a = [](MisuseState& s) -> auto& { return s.a; };
  auto b = [](MisuseState& s) -> auto& { return s.b; };
  auto c = [](MisuseState& s) -> auto& { return s.c; };
  auto call = [&](int64_t which) {
    switch (which) {
      case 1: team.Each([](int64_t, MisuseState&) {}); break;
      case 2: team.Sync(); break;
      case 3: team.Commit(); break;
      case 4: team.template WaitSync<0>(); break;
      case 5:
        team.Butterfly(1, 2, [](MisuseState& s) -> auto& { return s.v; }, [](float x, float y) { return x + y; });
        break;
      case 6: team.SyncOr([](MisuseState& s) { return s.v[0] != 0.0f; }); break;
      case 7: team.template Mma<F16>(a, b, c); break;
      case 8: team.template LoadMatrix<2, false>(mem, [](int64_t, MisuseState&) { return int64_t{0}; }, a); break;
      case 9: team.template MatMul<F16, false, false>(mem, cuda::WarpProduct{}); break;
      default: break;
    }
  };
  if (op == 0)
    for (int64_t which = 1; which <= 9; ++which) call(which);
  else
    team.Each([&](int64_t, MisuseState&) { call(op); });
  return report.divergent;
}

}  // namespace
}  // namespace kvcache

using namespace kvcache;

extern "C" {

// MultiHeadAttention: returns KVCACHE_OP_* for an invalid call (the message says why), 4 when a check flagged an
// access (the message lists the first few), 0 otherwise; the output is written in place.
__attribute__((visibility("default"))) int32_t mha_host_run(const KvcacheMultiHeadAttentionAttrs* attrs,
                                                            const KvcacheTensor inputs[9], const KvcacheTensor* output,
                                                            const AttnHostRunOptions* options,
                                                            AttnHostRunReport* report, char* message,
                                                            size_t message_size) {
  return HostEntry(report, message, message_size, [&](std::string* faults) {
    MhaAttrs a;
    TensorArg in[kMhaNumInputs];
    const MhaPlan plan = ValidateMhaWithOutput(attrs, inputs, output, &a, in);  // the C entry's checks
    const cuda::AttnTensors t{in[0].data, in[1].data, in[2].data, nullptr, nullptr,
                              in[kMhaMaskInput].present ? in[kMhaMaskInput].data : nullptr, output->data};
    return RunPlanned(a, plan, nullptr, in, t, 0, 0, *options, report, faults);
  });
}

// MultiHeadCacheAttention: the stores (KeyValueCache's store kernel, unchecked), then the attention, checked.
__attribute__((visibility("default"))) int32_t mhca_host_run(const KvcacheMultiHeadCacheAttentionAttrs* attrs,
                                                             const KvcacheTensor inputs[13],
                                                             const KvcacheTensor* output,
                                                             const AttnHostRunOptions* options,
                                                             AttnHostRunReport* report, char* message,
                                                             size_t message_size) {
  return HostEntry(report, message, message_size, [&](std::string* faults) {
    MhcaAttrs a;
    TensorArg in[kMhcaNumInputs];
    const MhcaPlan plan = ValidateMhcaWithOutput(attrs, inputs, output, &a, in);  // the C entry's checks
    const TensorArg &scale = in[kMhcaScaleInput], &mask = in[kMhcaMaskInput];
    void* cache = const_cast<void*>(in[kMhcaCacheInput].data);
    const StoresCall stores{a.cache,
                            plan.cache,
                            {in[1].data, in[2].data, cache, scale.present ? const_cast<void*>(scale.data) : nullptr,
                             nullptr, nullptr},
                            in[0].type,
                            scale.type,
                            static_cast<int>(a.cache.quant_bit)};
    const cuda::CacheSide side{&a.cache, &plan.cache};
    const cuda::AttnTensors t{in[0].data, nullptr, nullptr, cache, scale.present ? scale.data : nullptr,
                              mask.present ? mask.data : nullptr, output->data};
    return RunPlanned(a.attention, plan.attention, &side, in, t, scale.type, static_cast<int>(a.cache.quant_bit),
                      *options, report, faults, &stores);
  });
}

// The runner's check of block-wide operations inside team.Each (TeamMisuse), for the tests.
__attribute__((visibility("default"))) int64_t attn_host_team_misuse(int64_t op) { return TeamMisuse(op); }

}  // extern "C"
