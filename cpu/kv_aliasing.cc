// The aliasing rule of a validated call: no cache slot is stored twice, and a stored slot is loaded only
// by its own sequence at its own position (spec: Errors; reference/validate.py check_aliasing).
//
// Stores and loads are checked as runs of consecutive slots (a sequence's positions within one page, or
// its whole range in offset mode), not slot by slot: a decode step of 256 sequences loading 2048
// positions each in pages of 16 is 32768 load runs against 256 store runs. A bitmap of the coarse slot
// buckets that hold a store lets almost every load run pass without a search, so the check costs a few
// nanoseconds per page. The error messages are the per-slot ones the reference gives.
#include <algorithm>
#include <tuple>
#include <vector>

#include "kv_validate.h"

namespace kvcache {
namespace {

struct Run {
  int64_t begin, len, b;
  uint64_t pos;  // position of slot `begin`; start_pos[b] + i may exceed INT64_MAX
  int64_t End() const { return begin + len; }
};

// Reports the duplicate store the reference reports: the one whose second store comes first in
// (sequence, position) order. Runs only when the runs overlap, so it may go slot by slot.
[[noreturn]] void FailDuplicateStore(const Attrs& a, const CallPlan& p, const std::vector<int64_t>& seq_len) {
  struct Owner {
    int64_t slot, b;
    uint64_t pos;
  };
  std::vector<Owner> stores;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < seq_len[b]; ++i) {
      const uint64_t pos = static_cast<uint64_t>(p.start_pos[b]) + static_cast<uint64_t>(i);
      stores.push_back({SlotOf(p, a, b, pos), b, pos});
    }
  std::stable_sort(stores.begin(), stores.end(), [](const Owner& x, const Owner& y) { return x.slot < y.slot; });
  const Owner* first = nullptr;
  const Owner* second = nullptr;
  for (size_t k = 1; k < stores.size(); ++k) {
    if (stores[k].slot != stores[k - 1].slot) continue;
    size_t start = k - 1;
    while (start > 0 && stores[start - 1].slot == stores[k].slot) --start;
    if (!second || std::tie(stores[k].b, stores[k].pos) < std::tie(second->b, second->pos)) {
      first = &stores[start];
      second = &stores[k];
    }
  }
  Fail("cachestarts: slot ", second->slot, " is stored twice in one call, by sequence ", first->b, " position ",
       first->pos, " and by sequence ", second->b, " position ", second->pos);
}

// Which coarse slot buckets hold a stored slot. A bucket is at least a page wide, so a load run (at
// most a page) spans at most two buckets; there are at most ~64 bits per load run, so building and
// probing the map costs about what the load runs do.
class StoreBuckets {
 public:
  StoreBuckets(const CallPlan& p, const Attrs& a, int64_t load_runs, const std::vector<Run>& stores) {
    if (a.cache_mode == 0) return;  // offset mode: a sequence is one load run, searched directly
    int64_t cap_bits = 64;
    while (cap_bits < (int64_t(1) << 20) && cap_bits / 64 < load_runs) cap_bits *= 2;
    while ((uint64_t(1) << shift_) < uint64_t(a.page_size)) ++shift_;
    while (((p.max_t - 1) >> shift_) >= cap_bits) ++shift_;
    bits_.assign(static_cast<size_t>(((p.max_t - 1) >> shift_) / 64 + 1), 0);
    for (const Run& r : stores)
      for (int64_t k = r.begin >> shift_; k <= (r.End() - 1) >> shift_; ++k) bits_[k / 64] |= uint64_t(1) << (k % 64);
  }
  // False only when no stored slot lies in [begin, begin + len), len <= the bucket width (always true in
  // offset mode, which has no map).
  bool MayHold(int64_t begin, int64_t len) const {
    return bits_.empty() || Has(begin >> shift_) || Has((begin + len - 1) >> shift_);
  }

 private:
  bool Has(int64_t k) const { return (bits_[k / 64] >> (k % 64)) & 1; }
  int shift_ = 0;
  std::vector<uint64_t> bits_;
};

}  // namespace

void CheckAliasing(const Attrs& a, const CallPlan& p, const std::vector<int64_t>& seq_len,
                   const std::vector<int64_t>& kv_len) {
  std::vector<Run> stores;
  for (int64_t b = 0; b < p.batch; ++b)
    ForEachSlotRun(p, a, b, static_cast<uint64_t>(p.start_pos[b]), seq_len[b], [&](int64_t i, int64_t slot, int64_t n) {
      stores.push_back(Run{slot, n, b, static_cast<uint64_t>(p.start_pos[b]) + static_cast<uint64_t>(i)});
    });
  if (stores.empty()) return;
  std::sort(stores.begin(), stores.end(), [](const Run& x, const Run& y) { return x.begin < y.begin; });
  for (size_t k = 1; k < stores.size(); ++k)
    if (stores[k].begin < stores[k - 1].End()) FailDuplicateStore(a, p, seq_len);
  // The store runs are now disjoint and sorted, so their ends are sorted too.
  int64_t load_runs = 0;
  for (int64_t b = 0; b < p.batch; ++b)  // no overflow: at most kv_len[b] runs each, and their sum fits
    load_runs += a.cache_mode == 0 ? 1 : (kv_len[b] ? (kv_len[b] - 1) / a.page_size + 1 : 0);
  const StoreBuckets buckets(p, a, load_runs, stores);
  for (int64_t b = 0; b < p.batch; ++b)
    ForEachSlotRun(p, a, b, 0, kv_len[b], [&](int64_t t, int64_t slot, int64_t n) {
      const Run load{slot, n, b, static_cast<uint64_t>(t)};
      if (!buckets.MayHold(load.begin, load.len)) return;
      auto it = std::partition_point(stores.begin(), stores.end(), [&](const Run& r) { return r.End() <= load.begin; });
      for (; it != stores.end() && it->begin < load.End(); ++it) {
        // Both runs advance one position per slot, so they agree on the whole overlap if they agree at its
        // first slot; if not, that slot is the first of this load run to break the rule.
        const int64_t slot = std::max(it->begin, load.begin);
        const uint64_t stored_pos = it->pos + static_cast<uint64_t>(slot - it->begin);
        const uint64_t loaded_pos = load.pos + static_cast<uint64_t>(slot - load.begin);
        if (it->b != b || stored_pos != loaded_pos)
          Fail("cachestarts: slot ", slot, " is stored by sequence ", it->b, " position ", stored_pos,
               " and loaded in the same call by sequence ", b, " position ", loaded_pos,
               "; a stored slot may only be loaded by its own sequence at its own position");
      }
    });
}

}  // namespace kvcache
