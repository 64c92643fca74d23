// Streaming stores of an output written row by row at any alignment, as whole 64-byte cache lines only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "kv_cpu_rows.h"

namespace kvcache {
namespace KV_CPU_ISA {

// A streaming store is fast only where its cache line is written whole in quick succession: a line left part
// written when its write-combining buffer is given up costs a slow partial write to memory (measured on an Intel
// Xeon, one core, int8 layout-3 decode into outputs 16 bytes past a line: 0.13x a copy, against 0.8x on lines).
// The rows a gather writes rarely start on lines (numpy's arrays start 16 bytes past one; a head row of eight
// float16 values is 16 bytes), and its orders (head by head in layout 3, streams side by side) write a line's two
// parts far apart in time. So LineStreams streams the whole lines inside a row at once and keeps the part lines
// at its edges until the rows that complete them (the next head of a token, the next token) are written, in any
// order; only then is such a line streamed, whole. Lines still part written at Flush (shared with another task's
// rows), and lines pushed out of a full table when they are, are written with ordinary stores of this task's
// bytes only. The bytes in memory are the same whatever the order or alignment; only the speed differs.
class LineStreams {
 public:
  LineStreams() = default;
  LineStreams(const LineStreams&) = delete;
  LineStreams& operator=(const LineStreams&) = delete;
  ~LineStreams() {
    Flush();  // a writer that leaves its scope writes what it holds (the gathers Flush before their fence)
    if (borrowed_) ThisThread().lent = false;
  }

  // Writes src[0, bytes) to dst, as whole streamed lines (where this build has streaming stores; else memcpy).
  void Write(void* dst, const void* src, size_t bytes) {
#if KV_SSE2
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    unsigned char* const end = d + bytes;
    if (!OnCacheLine(d) && d != end) {  // the head of the row: part of a line another row shares
      const size_t n = std::min<size_t>(bytes, 64 - reinterpret_cast<uintptr_t>(d) % 64);
      Merge(d, s, n);
      d += n, s += n;
    }
    for (; end - d >= 64; d += 64, s += 64) StreamLine(d, s);
    if (d != end) Merge(d, s, static_cast<size_t>(end - d));
#else
    std::memcpy(dst, src, bytes);
#endif
  }

#if KV_AVX512
  // The bytes of v that `bits` selects, into the line at `line` (64-byte aligned): held with the line's other
  // parts; streamed once the line is whole.
  KV_ALWAYS_INLINE void MergeLine(unsigned char* line, __m512i v, __mmask64 bits) {
    const int i = SlotOf(reinterpret_cast<uintptr_t>(line));
    if (MergeHeldLine(table_->data[i], table_->filled[i], line, v, bits)) Free(i);
  }
#endif

  // Writes every line still held part written, with ordinary stores of the bytes this task wrote. Call before
  // the task ends (the lines belong to the outputs, not to this object).
  void Flush() {
    if (table_ == nullptr) return;
    for (int w = 0; w < kSlots / 64; ++w)
      for (uint64_t m = table_->used[w]; m != 0; m &= m - 1) WritePart(w * 64 + __builtin_ctzll(m));
  }

 private:
  // Lines held at once. Head order holds about two per token of a task (a head row's tail until the next head's
  // pass, a token's first head until its last): about 128 for the gathers' 64 tokens, so the table stays mostly
  // empty and a line rarely finds both its slots taken: a line pushed out is written part by part with ordinary
  // stores, each reading its line in first (several times slower).
  static constexpr int kSlots = 1024;

  struct Table {
    alignas(64) unsigned char data[kSlots][64];  // the bytes a slot's line holds so far
    uintptr_t line[kSlots];                      // the line a used slot holds
    uint64_t filled[kSlots];                     // which of its bytes this task wrote
    uint64_t used[kSlots / 64] = {};             // which slots are used (nothing else is read of a free one)
  };

  // Bits [offset, offset + n) of a line's byte mask.
  static uint64_t Bits(size_t offset, size_t n) { return (n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1) << offset; }

  static void StreamLine(void* dst, const void* src) {
#if KV_AVX512
    _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_loadu_si512(src));
#elif KV_SIMD
    for (int k = 0; k < 64; k += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<char*>(dst) + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const char*>(src) + k)));
#elif KV_SSE2
    for (int k = 0; k < 64; k += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<char*>(dst) + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const char*>(src) + k)));
#else
    std::memcpy(dst, src, 64);
#endif
  }

  // The bytes src[0, n) at d, inside one line: held with the line's other parts; streamed once the line is whole.
  void Merge(unsigned char* d, const unsigned char* src, size_t n) {
    const size_t offset = reinterpret_cast<uintptr_t>(d) % 64;
#if KV_AVX512
    // One masked load places the bytes at their offset in the line (masked-off bytes are not read).
    const __mmask64 bits = Bits(offset, n);
    MergeLine(d - offset, _mm512_maskz_loadu_epi8(bits, src - offset), bits);
#else
    const int i = SlotOf(reinterpret_cast<uintptr_t>(d - offset));
    std::memcpy(table_->data[i] + offset, src, n);
    if ((table_->filled[i] |= Bits(offset, n)) == ~uint64_t{0}) {
      StreamLine(reinterpret_cast<void*>(table_->line[i]), table_->data[i]);
      Free(i);
    }
#endif
  }

  bool Used(int i) const { return (table_->used[i / 64] >> (i % 64)) & 1; }
  void Free(int i) { table_->used[i / 64] &= ~(uint64_t{1} << (i % 64)); }

  // The slot holding `line`, else one of its two free slots taken for it, else its first slot given up (its
  // line written part by part) and taken.
  KV_ALWAYS_INLINE int SlotOf(uintptr_t line) {
    if (table_ == nullptr) table_ = Acquire();  // on first use: most tasks stream nothing
    const uint64_t key = (line >> 6) * 0x9E3779B97F4A7C15ull;
    const int first = static_cast<int>(key >> 54), second = static_cast<int>((key >> 40) % kSlots);
    if (Used(first) && table_->line[first] == line) return first;
    if (Used(second) && table_->line[second] == line) return second;
    int i = first;
    if (Used(first)) {
      if (Used(second)) {
        WritePart(first);
      } else {
        i = second;
      }
    }
    table_->used[i / 64] |= uint64_t{1} << (i % 64);
    table_->line[i] = line;
    table_->filled[i] = 0;
    return i;
  }

  // Slot i's bytes written to its line with ordinary stores (only the bytes this task wrote), the slot freed.
  void WritePart(int i) {
    auto* line = reinterpret_cast<unsigned char*>(table_->line[i]);
    for (uint64_t m = table_->filled[i]; m != 0;) {
      const int begin = __builtin_ctzll(m);
      const uint64_t rest = ~(m >> begin);  // zero bits from `begin` on: the run's bytes
      const int end = rest == 0 ? 64 : begin + __builtin_ctzll(rest);
      std::memcpy(line + begin, table_->data[i] + begin, static_cast<size_t>(end - begin));
      m = end == 64 ? 0 : m & (~uint64_t{0} << end);
    }
    Free(i);
  }

  // This thread's table, kept from task to task (a fresh 80 KB per task cost its page faults), or one of this
  // writer's own where another writer of this thread holds it. Empty either way: Flush frees every slot.
  struct Kept {
    std::unique_ptr<Table> table;
    bool lent = false;
  };
  static Kept& ThisThread() {
    thread_local Kept kept;
    return kept;
  }
  Table* Acquire() {
    Kept& kept = ThisThread();
    if (kept.lent) {
      own_.reset(new Table);
      return own_.get();
    }
    if (!kept.table) kept.table.reset(new Table);
    kept.lent = borrowed_ = true;  // empty: every writer flushes (frees every slot) as it ends
    return kept.table.get();
  }

  Table* table_ = nullptr;
  std::unique_ptr<Table> own_;
  bool borrowed_ = false;
};

#if KV_AVX512
// Cuts each output line of a row starting `offset` (even) bytes past a line from the row's two vectors the line
// straddles: element j of the line is element n - k + j of the first below k, else element j - k of the second (n
// elements a vector, k of them in `offset` bytes; permutex2var reads indices of n and up from its second vector, so one
// sum gives both). Offsets of whole 4-byte dwords (every output numpy or ONNX Runtime allocates) take the dword
// permute, VPERMT2D: one uop, on port 5, where the word (2-byte) VPERMT2W is three on Intel's Skylake-SP to Ice Lake
// and Rocket Lake cores (two on port 5), and port 5 also does the dequantization's widening, lane and float16 steps
// (measured on an Intel Xeon of family 6 model 167, one core, side by side, 9 rounds, int8 decode into outputs 16 bytes
// past a line: 3.7-3.8% less time in layouts 0 and 1 and with 32 heads in layout 3, layout 0 0.77x -> 0.80x a copy; the
// same within noise on lines, where no line is cut; on an AMD EPYC of Zen 4, two runs of 11 rounds, int8 decode with
// 8 heads in layout 3 took 5-15% less time, with 32 heads mixed, the other rows within noise). ShiftedRow's and
// OffsetRow's.
class LineCut {
 public:
  explicit LineCut(int offset)
      : halves_(offset % 4 != 0),
        index_(halves_ ? _mm512_add_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17,
                                                           16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi16(static_cast<int16_t>(32 - offset / 2)))
                       : _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16 - offset / 4))) {}

  // The line whose first `offset` bytes are the last of `before` and whose others are the first of `v`.
  KV_ALWAYS_INLINE __m512i operator()(__m512i before, __m512i v) const {
    // The dword permute laid out as the fall-through of the hot loops: it is every allocator's case.
    if (__builtin_expect(halves_, 0)) return _mm512_permutex2var_epi16(before, index_, v);
    return _mm512_permutex2var_epi32(before, index_, v);
  }

  // fn(cut), cut(before, v) the line operator() gives, its permute chosen once, before fn runs: a loop inside fn
  // carries no test of the offset per line.
  template <class Fn>
  KV_ALWAYS_INLINE void Visit(Fn&& fn) const {
    const __m512i index = index_;
    if (__builtin_expect(halves_, 0)) {
      fn([index](__m512i before, __m512i v)
             __attribute__((always_inline)) { return _mm512_permutex2var_epi16(before, index, v); });
    } else {
      fn([index](__m512i before, __m512i v)
             __attribute__((always_inline)) { return _mm512_permutex2var_epi32(before, index, v); });
    }
  }

 private:
  bool halves_;  // the offset is an odd number of 2-byte halves of a dword
  __m512i index_;
};

// A row of whole 64-byte vectors (in output order) streamed to out at any even byte offset from a line: each
// line is cut from two neighbouring vectors in registers (one permute), so a row dequantized into registers is
// streamed without a round trip through memory; the part lines at its two edges go through LineStreams when the
// row ends. The vector carried from one Put to the next is the caller's local (`previous`), not a member: as a
// member the compiler kept it in memory, and each Put's load of it waited for the store of the Put before, behind
// the streaming stores ahead of that (measured on an AMD EPYC of Zen 4, rows of 2 KiB streamed 16 bytes past a
// line, one core: 14-19 GB/s so, 20-22 GB/s with a local, 23-25 GB/s on lines; int8 decode into such outputs,
// layout 0, 25.4 -> 18.2 ms).
//
// A row whose neighbours in the output are written by the same writer need not hold its part lines: given `led`
// (the caller starts `previous` as the 64 bytes just before out, the end of the row before it), its first line is
// streamed whole; given `tail_follows` (the row after it is written, led, by the same writer), its last part line
// is left to that row. Each line is then streamed whole, once, and none waits in the table (measured on an AMD
// EPYC of Zen 4, one core, decode into outputs 16 bytes past a line: int8 layout 0 0.98x -> 1.11x a copy, float16
// layout 1 0.81x -> 1.04x; benchmarks/cpu/bound/quantize_cost.cc times chained rows against held ones).
class ShiftedRow {
 public:
  // out: an even address (every caller's elements are 2 or 4 bytes); the row is Put as whole 64-byte vectors.
  ShiftedRow(LineStreams& lines, void* out, bool led = false, bool tail_follows = false)
      : lines_(lines),
        line_(static_cast<unsigned char*>(out) - reinterpret_cast<uintptr_t>(out) % 64),
        first_line_(line_),
        held_line_(led ? nullptr : line_),
        tail_follows_(tail_follows),
        offset_(static_cast<int>(reinterpret_cast<uintptr_t>(out) % 64)),
        cut_(offset_) {}

  // The next 64 bytes of the row; `previous`: the caller's local, before the first Put zero (or, led, the 64
  // bytes before out), handed to every Put and to End.
  KV_ALWAYS_INLINE void Put(__m512i v, __m512i& previous) {
    if (offset_ == 0) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(line_), v);
    } else {
      const __m512i line = cut_(previous, v);
      if (line_ == held_line_) {
        head_ = line;  // a part line: merged as the row ends, so that no call interrupts the Puts
      } else {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(line_), line);
      }
      previous = v;
    }
    line_ += 64;
  }
  // The row's two part lines, its first (unless led) and its last (unless tail_follows); call once, after the last
  // Put.
  KV_ALWAYS_INLINE void End(__m512i previous) {
    if (offset_ == 0 || line_ == first_line_) return;
    if (held_line_ != nullptr) lines_.MergeLine(first_line_, head_, ~uint64_t{0} << offset_);
    if (!tail_follows_)
      lines_.MergeLine(line_, cut_(previous, _mm512_setzero_si512()),
                       (uint64_t{1} << offset_) - 1);
  }

 private:
  LineStreams& lines_;
  unsigned char* line_;        // the line the next Put's bytes begin in
  unsigned char* first_line_;  // the line the row begins in
  unsigned char* held_line_;   // the same, held until End; nullptr where led (streamed whole by its Put)
  bool tail_follows_;          // the row's last part line is the next row's first
  int offset_;                 // the row's byte offset in its first line (even)
  LineCut cut_;                // the permute for that offset
  __m512i head_ = _mm512_setzero_si512();  // the row's first line, until End merges it
};
#endif

// The rows srcs[0, count), `bytes` bytes each, one after another at dst, written as one row through `lines`. Where
// this build has AVX-512, dst is off a line and the rows are whole 64-byte vectors, each line is cut from their
// vectors in registers (ShiftedRow), so a line two neighbouring rows share is streamed whole at once instead of
// waiting in the table:
// a token's head rows from layout 3's H cache rows are one output row (measured on an Intel Xeon, float16 decode
// into outputs 16 bytes past a line: 0.66x a copy head row by head row, 0.93x so). Elsewhere row by row (Write).
// With AVX-512 such rows take `lead` (not null: the 64 bytes before dst in the output, of a row the same writer
// writes with tail_follows) and `tail_follows` as ShiftedRow's led and tail_follows; elsewhere they are ignored.
inline void WriteRows(LineStreams& lines, const void* const* srcs, int64_t count, size_t bytes, void* dst,
                      const void* lead = nullptr, bool tail_follows = false) {
  auto* out = static_cast<unsigned char*>(dst);
#if KV_AVX512
  // On a line, rows of whole lines are streamed row by row (Write's tight loop: measured 10% faster than the
  // shifted row's for float16 layout-2 decode, one core, Zen 4).
  if (bytes % 64 == 0 && reinterpret_cast<uintptr_t>(out) % 2 == 0 && !OnCacheLine(out)) {
    const bool led = lead != nullptr;
    ShiftedRow row(lines, out, led, tail_follows);
    __m512i previous = led ? _mm512_loadu_si512(lead) : _mm512_setzero_si512();
    for (int64_t r = 0; r < count; ++r)
      for (size_t k = 0; k < bytes; k += 64)
        row.Put(_mm512_loadu_si512(static_cast<const unsigned char*>(srcs[r]) + k), previous);
    row.End(previous);
    return;
  }
#endif
  (void)lead, (void)tail_follows;
  for (int64_t r = 0; r < count; ++r) lines.Write(out + static_cast<size_t>(r) * bytes, srcs[r], bytes);
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
