#include "kv_cpu.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kv_cpu_quant_rows.h"
#include "kv_cpu_rows.h"
#include "spec_float_mode.h"
#include "kv_cpu_type_dispatch.h"
#include "kv_interleaved_streams.h"
#include "kv_line_streams.h"
#include "kv_row_streams.h"
#include "kv_types.h"

// Built once per instruction set; KV_CPU_ISA names the namespace (see kv_cpu_dispatch.cc).
namespace kvcache {
namespace KV_CPU_ISA {
namespace {

constexpr int64_t kRowsPerTask = 64;  // tokens per parallel task: large enough to amortize scheduling

// Gathers ask for cache rows this far ahead of their use (software prefetch): kAheadTokens tokens in token
// order (layout 3's groups of heads included), kAheadRows rows of the same head in layout 3's head order.
constexpr int64_t kAheadTokens = 2, kAheadRows = 8;
// Streamed unquantized gathers read this many source streams side by side, a head row from each in turn:
// one core keeps more reads in flight over several streams than down one (measured on the benchmark's
// float16 decode step: 0.83-0.89x a copy walking one stream, 0.87-1.06x walking four; eight gain no more).
constexpr int64_t kStreams = 4;
// Side by side, unquantized gathers read tiles of this many bytes of whole tokens as kStreams streams (measured best
// on the first Intel machine's decode step).
constexpr int64_t kSideBySideTileBytes = int64_t{32} << 10;
// Streamed unquantized gathers in token order that read token_streams runs side by side take this many bytes of a
// row from each run in turn (measured on an Intel Xeon of model 167, one core: 128, 256 and 512 level).
constexpr size_t kRowStreamChunkBytes = 256;
static_assert(kMaxTokenStreams <= kMaxRowStreams, "every count TokenStreams gives is walked as asked");

// Sequence of a row in a starts vector (the last b with starts[b] <= row, skipping empty sequences).
int64_t SequenceOf(const int64_t* starts, int64_t batch, int64_t row) {
  return static_cast<int64_t>(std::upper_bound(starts + 1, starts + batch + 1, row) - (starts + 1));
}

// fn(row, slot, n, b, pos) for each run of rows in [row_begin, row_end): n rows of sequence b whose positions,
// and so their slots, are consecutive (within one page in paged mode), the first at position pos. Row r of
// sequence b is position first_pos[b] + r - starts[b] (first_pos: start_pos for stores; nullptr for loads, which
// start at 0).
template <class Fn>
void ForEachRun(const CallPlan& p, const Attrs& a, const std::vector<int64_t>& starts, const int64_t* first_pos,
                int64_t row_begin, int64_t row_end, Fn&& fn) {
  int64_t b = SequenceOf(starts.data(), p.batch, row_begin);
  for (int64_t r = row_begin; r < row_end;) {
    while (r >= starts[b + 1]) ++b;
    // start_pos >= 0 (validated); the sum may exceed INT64_MAX but not UINT64_MAX.
    const uint64_t pos = (first_pos ? static_cast<uint64_t>(first_pos[b]) : 0) + static_cast<uint64_t>(r - starts[b]);
    const int64_t end = std::min(row_end, starts[b + 1]);
    ForEachSlotRun(p, a, b, pos, end - r, [&](int64_t i, int64_t slot, int64_t n) { fn(r + i, slot, n, b, pos + i); });
    r = end;
  }
}

template <class T1, class T3, int QBits>
struct Kernel {
  using T = typename T1::Storage;
  using S = typename T3::Storage;
  using C = Codes<QBits>;
  const ComputeArgs& args;
  const Attrs& a;
  const CallPlan& p;
  bool stream;        // streaming stores for outputs too large to stay in cache
  bool parallel_streams;  // streamed unquantized gathers may read kStreams source streams side by side
  bool head_runs;         // quantized layout-3 gathers into cached outputs walk a head's page runs
  int64_t streamed_heads;  // layout-3 streamed gathers read this many heads a pass (one output row a slot)
  int64_t tile_bytes;  // token-order gathers (quantized: layouts 0-2) write each output in tiles of this many bytes
  int64_t token_streams;  // streamed unquantized token-order gathers read this many runs side by side (TokenStreams)
  int64_t prefetch_heads;  // heads of a token asked for ahead where they lie together (PrefetchHeadsOfToken)
  bool stream_codes;       // stores write quantized codes not read back with streaming stores (StreamedCodeStores)
  bool head_rows_to_l2;    // unquantized layout-3 head rows asked for into the second-level cache (HeadPrefetchToL2)

  // Element offset of cache row (kv, h, slot) of this call's layer, and of its scales.
  int64_t CacheRow(int kv, int64_t h, int64_t slot) const { return p.cache_rows.Row(a.layer_idx, kv, h, slot); }
  int64_t ScaleRow(int kv, int64_t h, int64_t slot) const { return p.scale_rows.Row(a.layer_idx, kv, h, slot); }
  const T* CacheValues(int kv, int64_t h, int64_t slot) const { return static_cast<const T*>(args.cache) + CacheRow(kv, h, slot); }
  auto CacheCodes(int kv, int64_t h, int64_t slot) const {
    return C::Row(static_cast<const void*>(args.cache), CacheRow(kv, h, slot));
  }
  const S* CacheScales(int kv, int64_t h, int64_t slot) const { return static_cast<const S*>(args.scale) + ScaleRow(kv, h, slot); }

  // Whether streamed unquantized gathers read kStreams source streams side by side (quantized ones never do).
  bool SideBySideStreams() const { return QBits == 0 && stream && parallel_streams; }

  // Layout 3 keeps a head's slots contiguous (a slot's heads lie MaxT rows apart).
  bool HeadMajor() const { return p.cache_rows.slot < p.cache_rows.head; }
  // Layouts 0-2 keep a slot's H heads contiguous, and their scales.
  bool HeadsAdjacent() const { return p.cache_rows.head == p.head_dim; }

  // Per-task scratch rows (RowScratch points into them), each up to one token's H heads.
  struct Scratch {
    std::vector<float> x, scale;  // a row as float32; its elements' scales
    std::vector<int32_t> codes;   // a row's codes
    std::vector<float> sf;        // a row's scales as float32, then 8 zero floats
    std::vector<T> row;           // a dequantized row on its way to a streamed output
    LineStreams lines;            // the streamed outputs' lines, written whole (Flush before the task ends)
    RowScratch Rows() { return RowScratch{x.data(), scale.data(), codes.data(), sf.data()}; }
  };
  Scratch MakeScratch() const {
    const auto d = static_cast<size_t>(p.heads * p.head_dim), g = static_cast<size_t>(p.heads * p.groups);
    return Scratch{std::vector<float>(d), std::vector<float>(d), std::vector<int32_t>(d), std::vector<float>(g + 8),
                   std::vector<T>(d), {}};
  }

  // Whether position t of sequence b is one this call stores (t >= 0). Where it is also loaded, its output row is
  // written by the store task, right after the store (`emit` in StoreRows), and the gathers leave it.
  bool Stored(int64_t b, int64_t t) const {
    return t >= p.start_pos[b] && t - p.start_pos[b] < p.seqstarts[b + 1] - p.seqstarts[b];
  }

  // Output row of the token at position t of sequence b, in key or value.
  T* OutRow(int kv, int64_t b, int64_t t) const {
    return static_cast<T*>(kv ? args.out_value : args.out_key) + (p.kvstarts[b] + t) * p.out_heads * p.head_dim;
  }

  void StoreRows(int64_t row_begin, int64_t row_end) const {
    const int64_t H = p.heads, D = p.head_dim;
    Scratch scratch = MakeScratch();
    const RowScratch rows = scratch.Rows();
    // Heads adjacent in the cache: one row of H * Dh per token and half. Layout 3 too goes token by token
    // (measured faster than head by head for stores: the source rows of a token lie together).
    const bool whole_token = HeadsAdjacent();
    // A stored token that the call also loads goes to its output rows as soon as it is stored: what the gather
    // would read, read back from the cache rows just written (still in the core's cache) by the gather's own
    // code, so the bits are the gather's; quantized rows that QuantizeRowsWithValues covers are not read back but
    // written from the codes and scales in registers, the same bits (int8 prefill, layout 3: its 2H head rows a
    // token lie 4 KiB-aligned apart, and reading them back cost a quarter of the call). The spec's aliasing rules
    // make this exact: no slot is stored twice in a call, so no later store changes the rows. (Prefill: the
    // whole output, without a second pass over the cache; measured in benchmarks/cpu.)
    bool emitted = false;
    // Where codes are streamed (rows not read back), layout 3's scale rows are too: a token's 2H rows continue 2H
    // streams, each written a whole line at a time (InterleavedStreams).
    const bool stream_scales = QBits != 0 && stream_codes && !whole_token;
    InterleavedStreams scale_streams(stream_scales ? 2 * H : 0);
    InterleavedStreams* const streams = stream_scales ? &scale_streams : nullptr;
    ForEachRun(p, a, p.seqstarts, p.start_pos.data(), row_begin, row_end, [&](int64_t r0, int64_t slot, int64_t n,
                                                                              int64_t b, uint64_t pos) {
      const T* sources[2] = {static_cast<const T*>(args.key) + r0 * H * D, static_cast<const T*>(args.value) + r0 * H * D};
      // Token i's kv rows into the cache. With `values` (not nullptr), quantized rows that QuantizeRowsWithValues
      // covers also go there as their values after DQ: returns whether they did. `loaded`: the token's output rows
      // come from this store, read back from the cache unless they went to `values` (codes then not streamed).
      auto store_token = [&](int kv, int64_t i, T* values, bool loaded) {
        const T* src = sources[kv] + i * H * D;
        if constexpr (QBits == 0) {
          if (whole_token) {
            std::memcpy(static_cast<T*>(args.cache) + CacheRow(kv, 0, slot + i), src, H * D * sizeof(T));
          } else {
            for (int64_t h = 0; h < H; ++h)
              std::memcpy(static_cast<T*>(args.cache) + CacheRow(kv, h, slot + i), src + h * D, D * sizeof(T));
          }
          return false;
        } else {
          // A token's heads: one row of H * Dh where they lie together, else H rows (layout 3) in one call.
          const int64_t heads_rows = whole_token ? 1 : H, row_size = whole_token ? H * D : D;
          const int64_t groups = whole_token ? H * p.groups : p.groups;
          const int64_t code_step = p.cache_rows.head * QBits / 8, scale_step = p.scale_rows.head;  // storage units
          auto* codes = C::Row(args.cache, CacheRow(kv, 0, slot + i));
          S* scales = static_cast<S*>(args.scale) + ScaleRow(kv, 0, slot + i);
          if (values != nullptr && QuantizeRowsWithValues<T1, T3, QBits>(src, heads_rows, row_size, a.quant_group, groups,
                                                                        codes, code_step, scales, scale_step, values,
                                                                        stream_codes, streams, kv * H))
            return true;
          const bool streamed = stream_codes && !loaded;
          QuantizeRows<T1, T3, QBits>(src, heads_rows, row_size, a.quant_group, groups, codes, code_step, scales,
                                      scale_step, rows, streamed, streamed ? streams : nullptr, kv * H);
          return false;
        }
      };
      for (int64_t i = 0; i < n; ++i) {
        // pos may pass INT64_MAX in paged mode (a page table reaching that far): compared unsigned, before any cast
        const uint64_t t = pos + static_cast<uint64_t>(i);
        const bool loaded = args.out_key != nullptr && t < static_cast<uint64_t>(p.kvstarts[b + 1] - p.kvstarts[b]);
        for (int kv = 0; kv < 2; ++kv) {
          if (!loaded) {
            store_token(kv, i, nullptr, false);
            continue;
          }
          T* out = OutRow(kv, b, static_cast<int64_t>(t));
          // Quantized rows without repeats: the output row is the source row's values after DQ, written as the
          // rows are quantized (into the streamed row first where the output is streamed); else read back.
          T* values = a.num_repeat == 1 ? (stream ? scratch.row.data() : out) : nullptr;
          if (store_token(kv, i, values, true)) {
            if (stream) Repeat(values, H * D, out, true, scratch);
          } else {
            EmitToken(kv, slot + i, out, scratch);
          }
          emitted = true;
        }
      }
    });
    if (emitted) scratch.lines.Flush();
    scale_streams.Flush();
    if (emitted || stream_codes) StoreFence();
  }

  // Cache rows (kv, h .. h + heads, slot) into dst, num_repeat copies of each (heads > 1 only without repeats:
  // then a token's heads lie together in the cache as in the output). Quantized rows are dequantized into
  // dst; when dst is streamed (`streamed`), with streaming stores where DequantizeRowsStreamed can, else into
  // scratch first.
  // Always inlined: a row is short work, called per head row in the gathers' inner loops.
  [[gnu::always_inline]] void EmitRows(int kv, int64_t h, int64_t slot, int64_t heads, T* dst, bool streamed,
                                       Scratch& scratch) const {
    if constexpr (QBits == 0) {
      Repeat(CacheValues(kv, h, slot), heads * p.head_dim, dst, streamed, scratch);
    } else {
      EmitCodes(CacheCodes(kv, h, slot), CacheScales(kv, h, slot), heads, dst, streamed, scratch);
    }
  }

  // EmitRows of quantized rows from their codes and scales.
  // `lead` and `tail_follows` as DequantizeRowsStreamed's.
  template <class Code>  // C::Storage (C is incomplete where QBits is 0)
  [[gnu::always_inline]] void EmitCodes(const Code* codes, const S* scales, int64_t heads, T* dst, bool streamed,
                                        Scratch& scratch, StreamedLead<Code, S> lead = {},
                                        bool tail_follows = false) const {
    if (streamed && a.num_repeat == 1 &&
        DequantizeRowsStreamed<T1, T3, QBits>(&codes, &scales, 1, a.quant_group, heads * p.groups, dst, scratch.lines,
                                              lead, tail_follows))
      return;
    const int64_t n = heads * p.head_dim;
    T* into = streamed ? scratch.row.data() : dst;
    DequantizeRow<T1, T3, QBits>(codes, scales, n, a.quant_group, heads * p.groups, into, scratch.Rows());
    Repeat(into, n, dst, streamed, scratch);
  }

  // The num_repeat copies of `row` (n values) into dst, one head_dim apart, but for dst itself; streamed
  // through the task's LineStreams (whole lines only, at any alignment), else with ordinary stores.
  [[gnu::always_inline]] void Repeat(const T* row, int64_t n, T* dst, bool streamed, Scratch& scratch) const {
    const auto bytes = static_cast<size_t>(n) * sizeof(T);
    for (int64_t k = 0; k < a.num_repeat; ++k) {
      T* to = dst + k * p.head_dim;
      if (row == to) continue;
      if (streamed) {
        scratch.lines.Write(to, row, bytes);
      } else {
        std::memcpy(to, row, bytes);
      }
    }
  }

  // The `heads` head rows whose values or codes start at rows[q] (their scales at scales[q]; layout 3's heads of a
  // token) into a streamed dst one after another, without repeats: one output row where this build can (WriteRows,
  // DequantizeRowsStreamed), so a line two heads share is streamed at once rather than held; else head by head.
  // `lead` and `tail_follows` as DequantizeRowsStreamed's; for values (QBits 0), lead.codes: the 64 bytes of
  // values before dst in the output (WriteRows).
  template <class Row>  // void, or C::Storage (C is incomplete where QBits is 0)
  [[gnu::always_inline]] void EmitHeadRows(const Row* const* rows, const S* const* scales, int64_t heads, T* dst,
                                           Scratch& scratch, StreamedLead<Row, S> lead = {},
                                           bool tail_follows = false) const {
    if constexpr (QBits == 0) {
      WriteRows(scratch.lines, rows, heads, static_cast<size_t>(p.head_dim) * sizeof(T), dst, lead.codes,
                tail_follows);
    } else if (!DequantizeRowsStreamed<T1, T3, QBits>(rows, scales, heads, a.quant_group, p.groups, dst, scratch.lines,
                                                      lead, tail_follows)) {
      for (int64_t q = 0; q < heads; ++q) EmitCodes(rows[q], scales[q], 1, dst + q * p.head_dim, true, scratch);
    }
  }

  // Heads h .. h + heads of slot `slot` (layout 3: H rows MaxT apart) into a streamed dst without repeats, as one
  // output row (EmitHeadRows), chained to the output row before it (head row (kv, before_head, before_slot);
  // before_slot kStoredRow: none this task writes) and, with tail_follows, to the one after.
  void EmitTokenHeads(int kv, int64_t h, int64_t heads, int64_t slot, T* dst, Scratch& scratch,
                      int64_t before_slot = kStoredRow, int64_t before_head = 0, bool tail_follows = false) const {
    const S* scales[kMaxStreamedHeads] = {};
    if constexpr (QBits == 0) {
      const void* rows[kMaxStreamedHeads];
      for (int64_t q = 0; q < heads; ++q) rows[q] = CacheValues(kv, h + q, slot);
      EmitHeadRows(rows, scales, heads, dst, scratch, LeadOf(kv, before_head, before_slot, p.head_dim), tail_follows);
    } else {
      const typename C::Storage* rows[kMaxStreamedHeads];
      for (int64_t q = 0; q < heads; ++q) rows[q] = CacheCodes(kv, h + q, slot), scales[q] = CacheScales(kv, h + q, slot);
      EmitHeadRows(rows, scales, heads, dst, scratch, LeadOf(kv, before_head, before_slot, p.groups), tail_follows);
    }
  }

  // The lead of the output row after the `n` values or groups from head row (kv, head, slot) on (which lie
  // together): of quantized rows their last 16 groups (DequantizeRowsStreamed), of values their last 64 bytes
  // (WriteRows). None where slot is kStoredRow, or where rows so made are never streamed chained (groups of other
  // than 8, a row shorter than 16 groups or 64 bytes), so that no pointer past the row is formed.
  template <int Q = QBits>  // a template so that Codes<0>, incomplete, is never named
  auto LeadOf(int kv, int64_t head, int64_t slot, int64_t n) const {
    if constexpr (Q == 0) {
      const int64_t last = n - 64 / int64_t(sizeof(T));
      return StreamedLead<void, S>{slot == kStoredRow || last < 0 ? nullptr : CacheValues(kv, head, slot) + last,
                                   nullptr};
    } else {
      if (slot == kStoredRow || a.quant_group != 8 || n < 16) return StreamedLead<typename Codes<Q>::Storage, S>{};
      const int64_t g = n - 16;
      return StreamedLead<typename Codes<Q>::Storage, S>{CacheCodes(kv, head, slot) + g * CodeBytes8(QBits),
                                                         CacheScales(kv, head, slot) + g};
    }
  }

  // The rows read after a head run's last, in order, up to kAheadRows of them (EmitHeadRun's `next`): row k is
  // heads h[k] .. h[k] + heads[k] of (kv[k], slot[k]).
  struct NextRows {
    int kv[kAheadRows] = {};
    int64_t h[kAheadRows] = {}, heads[kAheadRows] = {}, slot[kAheadRows] = {};
    int64_t count = 0;
    void Add(int row_kv, int64_t row_h, int64_t row_heads, int64_t row_slot) {
      kv[count] = row_kv, h[count] = row_h, heads[count] = row_heads, slot[count] = row_slot;
      ++count;
    }
  };
  // Prefetch of row k of `next`.
  void PrefetchNext(const NextRows& next, int64_t k) const {
    PrefetchHeads(next.kv[k], next.h[k], next.heads[k], next.slot[k]);
  }

  // Heads h .. h + heads of the m consecutive slots from `slot` (layout 3: a head's slots one after another in the
  // cache) into dst, out_row values apart: one pass down the run's rows (codes and scales, or values), their
  // addresses stepped rather than computed row by row, each row asked for `ahead` rows before its use. Quantized
  // rows: more than one head only into a streamed dst without repeats, each slot's heads then one output row
  // (EmitHeadRows). Values: only into a streamed dst, any number of heads; without repeats each slot's heads are
  // one output row (EmitHeadRows), with repeats each head's copies go through the task's lines (Repeat).
  // Into a streamed dst without repeats, each output row is chained to its neighbours in the output that this
  // task writes too (DequantizeRowsStreamed's and WriteRows' lead and tail_follows), so that no line they share
  // waits in the task's table: the row before the run's first token is of slot `before_slot` (kStoredRow: none
  // this task writes), and `after_written` says whether this task writes the token after the run's last.
  // Each row is asked for `ahead` (at most kAheadRows) rows before its use, the rows past the run's end from
  // `next`, the rows read after it: no pass starts cold, and the requests come one row at a time.
  void EmitHeadRun(int kv, int64_t h, int64_t heads, int64_t slot, int64_t m, int64_t ahead, T* dst, int64_t out_row,
                   bool streamed, Scratch& scratch, int64_t before_slot = kStoredRow, bool after_written = false,
                   const NextRows& next = {}) const {
    const bool chained = streamed && a.num_repeat == 1;  // else DequantizeRowsStreamed is not called
    // Row j + ahead of the run, or past its end the rows read after it (a run shorter than `ahead` finds its own
    // first rows after it asked for by the rows read before it).
    auto prefetch_ahead = [&](int64_t j) {
      if (j + ahead < m) {
        PrefetchHeads(kv, h, heads, slot + j + ahead);
      } else if (const int64_t k = j + ahead - m; k < next.count) {
        PrefetchNext(next, k);
      }
    };
    // The lead and tail_follows of slot j's output row (unused where not chained).
    auto chain = [&](int64_t j, auto& lead, bool& tail_follows) {
      if (!chained) return;
      const int64_t before = h > 0 ? slot + j : j > 0 ? slot + j - 1 : before_slot;  // the row before's slot
      lead = LeadOf(kv, h > 0 ? h - 1 : p.heads - 1, before, QBits == 0 ? p.head_dim : p.groups);
      tail_follows = h + heads < p.heads || j + 1 < m || after_written;
    };
    if constexpr (QBits == 0) {  // values: only into a streamed dst (GatherRows); repeats through Repeat
      const int64_t step = p.cache_rows.slot;
      const T* values[kMaxStreamedHeads];
      const S* scales[kMaxStreamedHeads] = {};
      for (int64_t q = 0; q < heads; ++q) values[q] = CacheValues(kv, h + q, slot);
      for (int64_t j = 0; j < m; ++j) {
        prefetch_ahead(j);
        StreamedLead<void, S> lead;
        bool tail_follows = false;
        chain(j, lead, tail_follows);
        if (a.num_repeat > 1) {  // each head's copies lie apart in the output row (through the task's lines)
          for (int64_t q = 0; q < heads; ++q)
            Repeat(values[q] + j * step, p.head_dim, dst + j * out_row + q * a.num_repeat * p.head_dim, streamed,
                   scratch);
          continue;
        }
        const void* rows[kMaxStreamedHeads];
        for (int64_t q = 0; q < heads; ++q) rows[q] = values[q] + j * step;
        EmitHeadRows(rows, scales, heads, dst + j * out_row, scratch, lead, tail_follows);
      }
    } else {
      using Code = typename C::Storage;
      const Code* codes[kMaxStreamedHeads];
      const S* scales[kMaxStreamedHeads];
      for (int64_t q = 0; q < heads; ++q)
        codes[q] = CacheCodes(kv, h + q, slot), scales[q] = CacheScales(kv, h + q, slot);
      const int64_t code_step = p.cache_rows.slot * QBits / 8, scale_step = p.scale_rows.slot;
      for (int64_t j = 0; j < m; ++j) {
        prefetch_ahead(j);
        StreamedLead<Code, S> lead;
        bool tail_follows = false;
        chain(j, lead, tail_follows);
        if (heads == 1) {
          EmitCodes(codes[0] + j * code_step, scales[0] + j * scale_step, 1, dst + j * out_row, streamed, scratch, lead,
                    tail_follows);
          continue;
        }
        const Code* row_codes[kMaxStreamedHeads];
        const S* row_scales[kMaxStreamedHeads];
        for (int64_t q = 0; q < heads; ++q)
          row_codes[q] = codes[q] + j * code_step, row_scales[q] = scales[q] + j * scale_step;
        EmitHeadRows(row_codes, row_scales, heads, dst + j * out_row, scratch, lead, tail_follows);
      }
    }
  }

  // Slots of load rows [row_begin, row_end) (position r - kvstarts[b] of sequence b); kStoredRow for a row whose
  // position this call stores (its store task has written its output rows).
  static constexpr int64_t kStoredRow = -1;
  std::vector<int64_t> LoadSlots(int64_t row_begin, int64_t row_end) const {
    std::vector<int64_t> slots(static_cast<size_t>(row_end - row_begin));
    ForEachRun(p, a, p.kvstarts, nullptr, row_begin, row_end, [&](int64_t r0, int64_t slot, int64_t n, int64_t b,
                                                                   uint64_t pos) {
      for (int64_t i = 0; i < n; ++i)
        slots[r0 - row_begin + i] = Stored(b, static_cast<int64_t>(pos) + i) ? kStoredRow : slot + i;
    });
    return slots;
  }

  // Asks for `heads` consecutive cache rows from (kv, h, slot), and their scales, ahead of their use: a
  // gather reads pages scattered over the cache, and the hardware prefetchers lose their stream at the end
  // of every page.
  template <int Locality = kEveryLevel>  // values only: codes and scales go to every level
  void Prefetch(int kv, int64_t h, int64_t slot, int64_t heads) const {
    if constexpr (QBits == 0) {
      PrefetchBytes<Locality>(CacheValues(kv, h, slot), heads * p.head_dim * int64_t(sizeof(T)));
    } else {
      PrefetchCodes(CacheCodes(kv, h, slot), CacheScales(kv, h, slot), heads);
    }
  }

  // Prefetch of `heads` consecutive quantized rows from their codes and scales.
  template <class Code>  // C::Storage, as EmitCodes
  void PrefetchCodes(const Code* codes, const S* scales, int64_t heads) const {
    PrefetchBytes(scales, heads * p.groups * int64_t(sizeof(S)));
    PrefetchBytes(codes, heads * p.head_dim * QBits / 8);
  }

  // Prefetch of a slot's heads: where they lie together one run of its first prefetch_heads, else all H head by head.
  void PrefetchToken(int kv, int64_t slot) const {
    if (HeadsAdjacent()) return Prefetch(kv, 0, slot, prefetch_heads);
    PrefetchHeads(kv, 0, p.heads, slot);
  }

  // Prefetch of heads h .. h + heads of a slot, head by head (layout 3's lie MaxT rows apart). Values go to the
  // second-level cache where head_rows_to_l2 says so: where MaxT is a power of two the heads' rows share their low
  // twelve bits and so their set of the first level, whose ways (eight on Zen 4) the eight heads of a pass, asked for
  // kAheadRows rows ahead, fill before anything else touches them (kv_cpu_dispatch.cc: HeadPrefetchToL2).
  void PrefetchHeads(int kv, int64_t h, int64_t heads, int64_t slot) const {
    for (int64_t q = 0; q < heads; ++q) {
      if (head_rows_to_l2) {  // values only (Launch)
        Prefetch<kSecondLevel>(kv, h + q, slot, 1);
      } else {
        Prefetch(kv, h + q, slot, 1);
      }
    }
  }

  // Token i of this gather task (slot `slot`) into output row dst: one row of H * Dh where a token's heads lie
  // together in the cache and in the output (layouts 0-2 without repeats); layout 3 streamed without repeats,
  // streamed_heads heads a row (EmitTokenHeads); else head by head.
  // Streamed rows without repeats are chained to the output rows beside them that this task writes (ShiftedRow's
  // led and tail_follows: no line they share waits in the task's table): `before`, the slot of the token whose
  // output row is just before dst (kStoredRow: none this task writes); `tail_follows`, the token after is this
  // task's too.
  void EmitToken(int kv, int64_t slot, T* dst, Scratch& scratch, int64_t before = kStoredRow,
                 bool tail_follows = false) const {
    const int64_t H = p.heads;
    if (a.num_repeat == 1 && HeadsAdjacent()) {
      if constexpr (QBits == 0) {
        if (!stream) return EmitRows(kv, 0, slot, H, dst, stream, scratch);
        const void* row = CacheValues(kv, 0, slot);
        return WriteRows(scratch.lines, &row, 1, static_cast<size_t>(H * p.head_dim) * sizeof(T), dst,
                         LeadOf(kv, 0, before, H * p.head_dim).codes, tail_follows);
      } else {  // the lead and tail_follows count only where the row is streamed (DequantizeRowsStreamed)
        return EmitCodes(CacheCodes(kv, 0, slot), CacheScales(kv, 0, slot), H, dst, stream, scratch,
                         LeadOf(kv, 0, before, H * p.groups), tail_follows);
      }
    }
    if (stream && a.num_repeat == 1 && streamed_heads > 1) {  // layout 3 streamed: heads a row at a time
      for (int64_t h = 0; h < H; h += streamed_heads) {
        const int64_t g = std::min(streamed_heads, H - h);
        EmitTokenHeads(kv, h, g, slot, dst + h * p.head_dim, scratch, h > 0 ? slot : before, h > 0 ? h - 1 : H - 1,
                       h + g < H || tail_follows);
      }
      return;
    }
    for (int64_t h = 0; h < p.heads; ++h) EmitRows(kv, h, slot, 1, dst + h * a.num_repeat * p.head_dim, stream, scratch);
  }

  void GatherRows(int64_t row_begin, int64_t row_end) const {
    const int64_t H = p.heads, D = p.head_dim, R = a.num_repeat, out_row = p.out_heads * D, rows = row_end - row_begin;
    // Layout 3 keeps a head's slots together. Its gathers into streamed outputs walk it streamed_heads heads at a
    // time over the task's rows (whole pages), each slot's heads one output row: a few source streams rather than
    // a token's 2H (quantized, one head a pass with repeats: codes and scales; values, unless streams side by
    // side: the rows themselves). A token's H head rows lie a multiple of 4 KiB apart where MaxT is a power of
    // two, in the same set of each cache level, so more streams than the sets' ways evict each other's lines
    // before they are read (measured on an AMD EPYC, one core: int8 decode 0.60-0.62x a copy head by head, 0.35x
    // token by token; float16 decode with 32 heads of 128, 0.43-0.48x token by token, 0.97-1.00x eight heads a
    // pass; kv_cpu_dispatch.cc has the counts). Head rows that do not start on lines leave part lines between heads:
    // the task's LineStreams holds them until the next head's row completes them (on an Intel Xeon, streamed part
    // lines took the step from 0.8x a copy to 0.13x), except inside a row of several heads, where they are cut in
    // registers (the Intel Xeon of model 207, int8 decode into outputs 16 bytes past a line: 0.44-0.55x a copy
    // head by head, 0.66-0.70x four heads a row; on lines 0.67-0.75x and 0.77-0.83x).
    // Quantized outputs that stay cached go head by head where CachedGatherHeadRuns says so (AMD: a column of head
    // rows written at a time costs less than the 4H streams), else token by token (Intel: each line of the column
    // is read in first; kv_cpu_dispatch.cc has the figures).
    const bool head_major = HeadMajor() && (QBits != 0 ? stream || head_runs : stream && !SideBySideStreams());
    const int64_t ahead = head_major ? kAheadRows : kAheadTokens;  // rows of a head / tokens
    const std::vector<int64_t> slots = LoadSlots(row_begin, std::min(p.kv_tokens, row_end + ahead));
    const auto count = static_cast<int64_t>(slots.size());
    auto out = [&](int kv, int64_t i) { return static_cast<T*>(kv ? args.out_value : args.out_key) + (row_begin + i) * out_row; };
    auto head_row = [&](int kv, int64_t i, int64_t h) { return out(kv, i) + h * R * D; };
    // The slot of the token before row i if this task writes its output rows (else kStoredRow), and whether it
    // writes the next token's: the chaining of streamed rows (EmitToken, EmitHeadRun).
    auto before = [&](int64_t i) { return i > 0 ? slots[i - 1] : kStoredRow; };
    auto after = [&](int64_t i) { return i + 1 < rows && slots[i + 1] != kStoredRow; };
    auto prefetch = [&](int kv, int64_t i) {
      if (i + ahead < count && slots[i + ahead] != kStoredRow) PrefetchToken(kv, slots[i + ahead]);
    };
    Scratch scratch = MakeScratch();
    if (head_major) {
      // Runs of consecutive slots (a page's) are one stream per head, read in one pass (EmitHeadRun): per kv, per
      // group of heads, run by run. Each row is asked for kAheadRows rows before it is read, across passes, and
      // the task's last rows ask for the next task's first: no pass starts cold, and no run starts with a burst
      // of requests. Measured on an AMD EPYC of Zen 4, one core, against runs that asked for the next run's first
      // rows all at once as they started, the first run of each kv and group of heads cold, with a first form of
      // this that asked for the next pass's first rows only (the same requests in pages of 8 slots or more):
      // int8 decode 0.93x -> 1.00x a copy, with pages of 16 slots 0.62x -> 0.79x; float16 with pages of 16 slots
      // 0.80x -> 0.90x, outputs 16 bytes past a line.
      struct Pass {
        int kv;
        int64_t h, heads, i, m;
      };
      std::vector<Pass> passes;
      passes.reserve(static_cast<size_t>(2 * H));
      const int64_t first_heads = stream && (R == 1 || QBits == 0) ? std::min(streamed_heads, H) : 1;
      for (int kv = 0; kv < 2; ++kv)
        for (int64_t h = 0, g = first_heads; h < H; h += g) {
          g = std::min(first_heads, H - h);  // heads a pass
          for (int64_t i = 0, m = 1; i < rows; i += m) {
            m = 1;
            if (slots[i] == kStoredRow) continue;
            while (i + m < rows && slots[i + m] == slots[i] + m) ++m;
            passes.push_back({kv, h, g, i, m});
          }
        }
      // The first `ahead` rows read after pass n's last (n = passes.size(): none): the passes after it, then the
      // next task's first rows (kv 0, the first heads, from row_end on; stored ones are not read).
      auto rows_after = [&](size_t n) {
        NextRows next;
        for (size_t f = n; f < passes.size() && next.count < ahead; ++f)
          for (int64_t j = 0; j < passes[f].m && next.count < ahead; ++j)
            next.Add(passes[f].kv, passes[f].h, passes[f].heads, slots[passes[f].i] + j);
        for (int64_t r = rows; r < count && next.count < ahead; ++r)
          if (slots[r] != kStoredRow) next.Add(0, 0, first_heads, slots[r]);
        return next;
      };
      const NextRows first = rows_after(0);  // the task's first rows
      for (int64_t k = 0; k < first.count; ++k) PrefetchNext(first, k);
      for (size_t n = 0; n < passes.size(); ++n) {
        const Pass& pass = passes[n];
        EmitHeadRun(pass.kv, pass.h, pass.heads, slots[pass.i], pass.m, ahead, head_row(pass.kv, pass.i, pass.h),
                    out_row, stream, scratch, before(pass.i), after(pass.i + pass.m - 1), rows_after(n + 1));
      }
    } else {
      // Tiles of whole tokens (GatherTileBytes: a token, or long runs per output), keys then values, save where
      // token_streams takes unquantized streamed rows whose heads are one row (below, before the tiles). Streamed
      // side by side (LineStreams writes lines whole in any order; unquantized rows only), a tile of
      // kSideBySideTileBytes is read as kStreams streams: in layout 3 a stream is a head's slots, kStreams heads at
      // a time; elsewhere a run of the tile's tokens.
      // Quantized rows take the layout's tiles too: a token at a time where a token's key and value rows lie
      // together (measured faster than tiles: int8 decode layout 0 0.72-0.75x a copy -> 0.85-0.90x), long tiles
      // where they lie apart (on an AMD EPYC of Zen 4, int8 decode with 32 heads of 128 in layout 2: 0.84x a token
      // at a time, 0.98x in 512 KiB tiles; 0.80x and 0.93x 16 bytes past a line; 8 heads level; on Intel processors
      // a token at a time, kv_cpu_dispatch.cc: GatherTileBytes). Quantized layout 3 here (outputs that stay cached,
      // on kinds that do not walk head runs for them) keeps a token at a time, as measured on the Intel Xeon.
      const bool side_by_side = SideBySideStreams();
#if KV_AVX512
      const size_t row_bytes = static_cast<size_t>(H * D) * sizeof(T);
      if (QBits == 0 && stream && !side_by_side && token_streams > 1 && R == 1 && HeadsAdjacent() &&
          rows <= kRowsPerTask && RowsGoSideBySide(out(0, 0), out(1, 0), row_bytes)) {
        // A token's H heads are one row in the cache and in the output: the task's rows, a token's key row then its
        // value row (which lie together in layouts 0 and 1), as token_streams runs side by side (measured on an
        // Intel Xeon of family 6 model 167, one core, kv_cpu_dispatch.cc: TokenStreams).
        StreamedRow list[2 * kRowsPerTask];
        int64_t n = 0;
        for (int64_t i = 0; i < rows; ++i)
          for (int kv = 0; kv < 2 && slots[i] != kStoredRow; ++kv)
            list[n++] = {CacheValues(kv, 0, slots[i]), out(kv, i), LeadOf(kv, 0, before(i), H * D).codes, after(i)};
        WriteRowsSideBySide(scratch.lines, list, n, row_bytes, token_streams, kRowStreamChunkBytes);
        scratch.lines.Flush();
        StoreFence();
        return;
      }
#endif
      const int64_t tile = QBits != 0 && HeadMajor() ? 1
                           : std::max<int64_t>(1, (side_by_side ? kSideBySideTileBytes : tile_bytes) /
                                                      (out_row * int64_t(sizeof(T))));
      for (int64_t i0 = 0; i0 < rows; i0 += tile) {
        const int64_t m = std::min(tile, rows - i0);
        for (int kv = 0; kv < 2; ++kv) {
          if (!side_by_side) {
            for (int64_t i = i0; i < i0 + m; ++i) {
              prefetch(kv, i);
              if (slots[i] != kStoredRow) EmitToken(kv, slots[i], out(kv, i), scratch, before(i), after(i));
            }
          } else if (HeadMajor()) {
            for (int64_t g = 0; g < H; g += kStreams)
              for (int64_t i = i0; i < i0 + m; ++i)
                for (int64_t h = g; h < std::min(H, g + kStreams); ++h) {
                  if (i + ahead < count && slots[i + ahead] != kStoredRow) Prefetch(kv, h, slots[i + ahead], 1);
                  if (slots[i] != kStoredRow) EmitRows(kv, h, slots[i], 1, head_row(kv, i, h), stream, scratch);
                }
          } else {
            const int64_t run = (m + kStreams - 1) / kStreams;  // stream j: tokens i0 + j * run + [0, run)
            for (int64_t t = 0; t < run; ++t) {
              for (int64_t i = i0 + t; i < i0 + m; i += run) prefetch(kv, i);
              for (int64_t h = 0; h < H; ++h)
                for (int64_t i = i0 + t; i < i0 + m; i += run)
                  if (slots[i] != kStoredRow) EmitRows(kv, h, slots[i], 1, head_row(kv, i, h), stream, scratch);
            }
          }
        }
      }
    }
    scratch.lines.Flush();
    StoreFence();
  }

  void Run(const ParallelFor& parallel_for) const {
    const int64_t store_tasks = (p.tokens + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(store_tasks, [this](size_t i) {
      const SpecFloatMode spec_mode;
      StoreRows(int64_t(i) * kRowsPerTask, std::min(p.tokens, int64_t(i + 1) * kRowsPerTask));
    });
    if (args.out_key == nullptr) return;  // stores only (MultiHeadCacheAttention reads the cache in place)
    const int64_t gather_tasks = (p.kv_tokens + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(gather_tasks, [this](size_t i) {
      const SpecFloatMode spec_mode;
      GatherRows(int64_t(i) * kRowsPerTask, std::min(p.kv_tokens, int64_t(i + 1) * kRowsPerTask));
    });
  }
};

// The build's name as the call report prints it (KV_CPU_ISA: generic, avx2 or avx512).
#define KV_ISA_TEXT(isa) #isa
#define KV_ISA_NAME(isa) KV_ISA_TEXT(isa)
constexpr const char* kBuildName = KV_ISA_NAME(KV_CPU_ISA);
#undef KV_ISA_NAME
#undef KV_ISA_TEXT

// Outputs (key + value) above this size are written with streaming stores.
constexpr int64_t kStreamOutputBytes = int64_t{32} << 20;

// How many of a token's heads, lying together, token-order gathers ask for ahead: of quantized rows those whose codes
// lie wholly in the first TokenPrefetchBytes (at least one; all where it is 0), else all of them.
template <int QBits>
int64_t PrefetchHeadsOfToken(const CallPlan& p) {
  if (QBits == 0) return p.heads;
  const int64_t head_bytes = std::max<int64_t>(1, p.head_dim * QBits / 8);
  const int64_t bytes = TokenPrefetchBytes(p.heads * head_bytes);
  if (bytes == 0) return p.heads;
  return std::clamp<int64_t>(bytes / head_bytes, 1, p.heads);
}

template <class T1, class T3, int QBits>
struct Launch {
  static void Run(const ComputeArgs& args, const ParallelFor& parallel_for) {
    const CallPlan& p = *args.plan;  // p.out_bytes: one output's size, checked by ValidateCall
    const StorePlan stores = LargeOutputStores();
    const bool large = p.out_bytes > kStreamOutputBytes / 2;
    const Kernel<T1, T3, QBits> kernel{
        args, *args.attrs, p, large && stores.stream, large && stores.side_by_side, CachedGatherHeadRuns(),
        std::min(StreamedGatherHeads(QBits != 0), kMaxStreamedHeads),
        GatherTileBytes(p.cache_rows.KeyValueTogether(), QBits != 0), TokenStreams(), PrefetchHeadsOfToken<QBits>(p),
        KV_AVX512 && QBits != 0 && args.out_key != nullptr && StreamedCodeStores(), QBits == 0 && HeadPrefetchToL2()};
    if (CallReportWanted()) Report(kernel);
    kernel.Run(parallel_for);
  }

  // The call's plan, one line on stderr (CallReportWanted): the build running it, whether its outputs are streamed
  // and whether its unquantized gathers read streams side by side (as the kernel decides them for this call), and
  // each other choice as passed to the kernel (a path of the call that does not take one ignores it).
  static void Report(const Kernel<T1, T3, QBits>& k) {
    const CallPlan& p = k.p;
    const bool gathers = k.args.out_key != nullptr;  // a stores-only call streams nothing, whatever its size
    std::fprintf(stderr,
                 "kvcache_op KeyValueCache cpu: build=%s quant_bit=%d layout=%lld tokens=%lld kv_tokens=%lld "
                 "heads=%lld head_dim=%lld outputs=%d out_bytes=%lld stream_outputs=%d side_by_side=%d "
                 "cached_gather=%s streamed_heads=%lld tile_bytes=%lld token_streams=%lld prefetch_heads=%lld "
                 "code_stores=%s head_prefetch=%s\n",
                 kBuildName, QBits, static_cast<long long>(k.a.cache_layout), static_cast<long long>(p.tokens),
                 static_cast<long long>(p.kv_tokens), static_cast<long long>(p.heads),
                 static_cast<long long>(p.head_dim), gathers ? 1 : 0,
                 static_cast<long long>(p.out_bytes), gathers && k.stream ? 1 : 0,
                 gathers && k.SideBySideStreams() ? 1 : 0,
                 k.head_runs ? "head-runs" : "tokens", static_cast<long long>(k.streamed_heads),
                 static_cast<long long>(k.tile_bytes), static_cast<long long>(k.token_streams),
                 static_cast<long long>(k.prefetch_heads), k.stream_codes ? "stream" : "cached",
                 k.head_rows_to_l2 ? "l2" : "l1");
  }
};

}  // namespace

void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for) {
  DispatchTypes<Launch>(args.t1, args.attrs->quant_bit, args.scale_type, args, parallel_for);
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
