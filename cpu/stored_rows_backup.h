// The cache and scale rows a validated call's stores overwrite, saved before the stores: a call that fails after
// them (MultiHeadCacheAttention, whose attention takes its working memory once the stores are done) puts them
// back, so that a failed call leaves the cache and scale byte for byte as it found them (spec: Errors).
#pragma once

#include <cstdint>
#include <vector>

#include "kv_validate.h"

namespace kvcache {

class StoredRowsBackup {
 public:
  // Copies every row the stores of (a, p) will write: for each stored position, its key and value rows of every
  // head in the cache (`cache_type`'s elements) and, quantized, in `scale` (`scale_type`'s). Rows that lie back to
  // back are saved as one run.
  StoredRowsBackup(const Attrs& a, const CallPlan& p, int32_t cache_type, int32_t scale_type, void* cache,
                   void* scale);
  // Writes the saved bytes back where they came from.
  void Restore() const noexcept;

 private:
  struct Run {
    uint8_t* at;
    int64_t bytes;
  };
  void Save(uint8_t* base, int64_t byte_offset, int64_t bytes);
  std::vector<Run> runs_;
  std::vector<uint8_t> saved_;
};

}  // namespace kvcache
