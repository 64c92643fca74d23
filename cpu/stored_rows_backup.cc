#include "stored_rows_backup.h"

#include <cstring>

#include "byte_ranges.h"

namespace kvcache {

StoredRowsBackup::StoredRowsBackup(const Attrs& a, const CallPlan& p, int32_t cache_type, int32_t scale_type,
                                   void* cache, void* scale) {
  // Bytes of a row, and the byte offset of an element offset: int4 rows are whole bytes (an even Dh is checked) and
  // a row offset is a multiple of Dh. An offset's bytes lie inside the cache, whose byte count fits in int64.
  const int64_t row_bytes = TensorBytes(cache_type, {p.head_dim});
  const bool int4 = a.quant_bit == 4;
  const int64_t elem_bytes = int4 ? 0 : row_bytes / p.head_dim;
  auto byte_offset = [&](int64_t elements) { return int4 ? elements / 2 : elements * elem_bytes; };
  const int64_t scale_bytes = scale ? TensorBytes(scale_type, {p.groups}) : 0;
  const int64_t scale_elem = scale ? scale_bytes / p.groups : 0;
  // One allocation: every stored token's key and value rows of every head (a run per row at most).
  const auto rows = static_cast<size_t>(p.tokens) * 2 * static_cast<size_t>(p.heads);
  saved_.reserve(rows * static_cast<size_t>(row_bytes + scale_bytes));
  runs_.reserve(rows * (scale ? 2 : 1));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.seqstarts[b + 1] - p.seqstarts[b]; ++i) {
      const int64_t slot = SlotOf(p, a, b, static_cast<uint64_t>(p.start_pos[b]) + static_cast<uint64_t>(i));
      for (int kv = 0; kv < 2; ++kv)
        for (int64_t h = 0; h < p.heads; ++h) {
          Save(static_cast<uint8_t*>(cache), byte_offset(p.cache_rows.Row(a.layer_idx, kv, h, slot)), row_bytes);
          if (scale) Save(static_cast<uint8_t*>(scale), p.scale_rows.Row(a.layer_idx, kv, h, slot) * scale_elem,
                          scale_bytes);
        }
    }
}

void StoredRowsBackup::Save(uint8_t* base, int64_t byte_offset, int64_t bytes) {
  uint8_t* at = base + byte_offset;
  saved_.insert(saved_.end(), at, at + bytes);
  if (!runs_.empty() && runs_.back().at + runs_.back().bytes == at)
    runs_.back().bytes += bytes;  // a slot's heads in layouts 0-2, its key and value rows in layouts 0-1
  else
    runs_.push_back({at, bytes});
}

void StoredRowsBackup::Restore() const noexcept {
  const uint8_t* from = saved_.data();
  for (const Run& run : runs_) {
    std::memcpy(run.at, from, static_cast<size_t>(run.bytes));
    from += run.bytes;
  }
}

}  // namespace kvcache
