// Test-only host runner of the CUDA kernels (KeyValueCache and KeyCacheRotaryShift): runs the kernels'
// per-thread work (cuda/kv_cache_work.h, cuda/rotary_work.h) for every (block, thread) of the exact grids
// the launchers use, on host buffers, with the params the GPU path builds (cuda/kv_cuda_params.h,
// cuda/rotary_params.h). Every access is traced per byte, and a launch is flagged when
//   (a) an access falls outside its buffer, or is misaligned for its size (both fault on a GPU);
//   (b) two threads of one launch write the same byte (a race on the GPU);
//   (c) a thread reads a byte that another thread of the same launch writes (a race on the GPU).
// Threads run one after another here, so a flagged access is reported, not undefined behaviour: an
// out-of-bounds access is never performed (loads read 0).
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "c_tensors.h"
#include "kv_cache_work.h"
#include "kv_cuda_params.h"
#include "kvcache_op.h"
#include "rotary_c_args.h"
#include "rotary_params.h"

extern "C" {
// Launch-shape overrides, to show the checks catch what the launcher's choices prevent (0: launcher's).
struct KvHostRunOptions {
  int64_t store_unit, gather_unit;
  int64_t buffer_bytes[kvcache::cuda::kBufCount];  // -1: the buffer's real size
};

struct KvHostRunReport {
  int64_t launches, blocks, threads, bytes_read, bytes_written;
  int64_t out_of_bounds, misaligned, write_write, read_write;
};

}  // extern "C"

namespace kvcache {
namespace {

using cuda::Buf;

constexpr int64_t kNobody = -1, kMany = -2;

const char* BufName(int b) {
  static const char* const names[] = {"seqstarts", "kvstarts", "start_pos", "cachestarts", "current_key",
                                      "current_value", "cache", "scale", "output key", "output value",
                                      "slots", "cos", "sin"};
  return names[b];
}

struct Shadow {  // who wrote / read one byte during the current launch
  int64_t writer = kNobody, reader = kNobody;
};

struct Faults {
  int64_t out_of_bounds = 0, misaligned = 0, write_write = 0, read_write = 0;
  std::vector<std::string> first;  // the first few, in words
  void Note(int64_t& counter, const std::string& what) {
    ++counter;
    if (first.size() < 6) first.push_back(what);
  }
  int64_t Total() const { return out_of_bounds + misaligned + write_write + read_write; }
};

struct Launch {
  const char* name;
  cuda::Grid grid;
};

std::string ThreadName(const Launch& l, int64_t id) {
  const int64_t tx = id % l.grid.threads, block = id / l.grid.threads;
  std::ostringstream s;
  s << "block (" << block % l.grid.blocks_x << ", " << block / l.grid.blocks_x << ") thread " << tx;
  return s.str();
}

// The memory policy of the runner: bounds and alignment checked per access, bytes traced by address
// (so two buffers that alias each other are traced as one memory).
struct TracingMem {
  char* base[cuda::kBufCount];
  int64_t bytes[cuda::kBufCount];
  std::unordered_map<uintptr_t, Shadow> shadow;
  Faults* faults;
  const Launch* launch = nullptr;
  int64_t thread = 0;
  int64_t bytes_read = 0, bytes_written = 0;

  bool Reach(Buf buf, int64_t offset, int64_t size, const char* verb) {
    if (base[buf] == nullptr || offset < 0 || offset > bytes[buf] - size) {
      std::ostringstream s;
      s << launch->name << ": " << ThreadName(*launch, thread) << " " << verb << " bytes [" << offset << ", "
        << offset + size << ") of " << BufName(buf) << ", which has " << bytes[buf] << " bytes";
      faults->Note(faults->out_of_bounds, s.str());
      return false;
    }
    if (reinterpret_cast<uintptr_t>(base[buf] + offset) % size != 0) {
      std::ostringstream s;
      s << launch->name << ": " << ThreadName(*launch, thread) << " " << verb << " " << size << " bytes at offset "
        << offset << " of " << BufName(buf) << ", not " << size << "-byte aligned";
      faults->Note(faults->misaligned, s.str());
      return false;
    }
    return true;
  }

  template <class T>
  T Load(Buf buf, int64_t offset) {
    T value{};
    if (!Reach(buf, offset, sizeof(T), "reads")) return value;
    for (size_t i = 0; i < sizeof(T); ++i) {
      Shadow& s = shadow[reinterpret_cast<uintptr_t>(base[buf] + offset + i)];
      if (s.reader == kNobody) s.reader = thread;
      else if (s.reader != thread) s.reader = kMany;
    }
    bytes_read += sizeof(T);
    std::memcpy(&value, base[buf] + offset, sizeof(T));
    return value;
  }

  template <class T>
  void Store(Buf buf, int64_t offset, T value) {
    if (!Reach(buf, offset, sizeof(T), "writes")) return;
    for (size_t i = 0; i < sizeof(T); ++i) {
      Shadow& s = shadow[reinterpret_cast<uintptr_t>(base[buf] + offset + i)];
      if (s.writer != kNobody && s.writer != thread) {
        std::ostringstream m;
        m << launch->name << ": " << ThreadName(*launch, thread) << " writes byte " << offset + i << " of "
          << BufName(buf) << ", already written by " << ThreadName(*launch, s.writer);
        faults->Note(faults->write_write, m.str());
      }
      s.writer = thread;
    }
    bytes_written += sizeof(T);
    std::memcpy(base[buf] + offset, &value, sizeof(T));
  }

  // (c): after a launch, any byte written by one thread and read by another.
  void CheckReadsAgainstWrites() {
    for (const auto& [address, s] : shadow) {
      if (s.writer == kNobody || s.reader == kNobody || s.reader == s.writer) continue;
      std::ostringstream m;
      m << launch->name << ": a byte at address " << std::hex << address << std::dec << " is written by "
        << ThreadName(*launch, s.writer) << " and read by "
        << (s.reader == kMany ? std::string("several threads") : ThreadName(*launch, s.reader));
      faults->Note(faults->read_write, m.str());
    }
  }
};

// Runs every (block, thread) of one launch's grid through a kernel's per-thread work, traced.
struct Tracer {
  TracingMem& mem;
  KvHostRunReport& r;
  template <class Body>
  void Each(Launch l, Body body) {
    if (l.grid.Empty()) return;
    mem.launch = &l;
    mem.shadow.clear();
    for (int64_t by = 0; by < l.grid.blocks_y; ++by)
      for (int64_t bx = 0; bx < l.grid.blocks_x; ++bx)
        for (int64_t tx = 0; tx < l.grid.threads; ++tx) {
          mem.thread = (by * l.grid.blocks_x + bx) * l.grid.threads + tx;
          body(bx, by, tx, l.grid.threads, l.grid.unit);
        }
    mem.CheckReadsAgainstWrites();
    r.launches += 1;
    r.blocks += l.grid.blocks_x * l.grid.blocks_y;
    r.threads += l.grid.blocks_x * l.grid.blocks_y * l.grid.threads;
  }
};

// The KeyValueCache launches: store, then gather (launch-shape overrides from the options).
struct Runner {
  const cuda::Params& p;
  const KvHostRunOptions& o;
  Tracer tracer;
  template <class T1, class T3, int QBits>
  int Run() {
    TracingMem& mem = tracer.mem;
    Launch store{"store launch", cuda::StoreGrid(p, QBits)};
    if (o.store_unit > 0) store.grid.unit = o.store_unit;
    tracer.Each(store, [&](int64_t bx, int64_t by, int64_t tx, int64_t n, int64_t unit) {
      cuda::StoreThread<T1, T3, QBits>(p, mem, unit, bx, by, tx, n);
    });
    Launch gather{"gather launch", cuda::GatherGrid(p)};
    if (o.gather_unit > 0) gather.grid.unit = o.gather_unit;
    tracer.Each(gather, [&](int64_t bx, int64_t by, int64_t tx, int64_t n, int64_t unit) {
      cuda::GatherThread<T1, T3, QBits>(p, mem, unit, bx, by, tx, n);
    });
    return 0;
  }
};

// The KeyCacheRotaryShift launch.
struct RotaryRunner {
  const cuda::RotaryParams& p;
  Tracer tracer;
  template <class T2, class T3, int QBits>
  int Run() {
    tracer.Each({"rotary launch", cuda::RotaryGrid(p)}, [&](int64_t bx, int64_t, int64_t tx, int64_t n, int64_t) {
      cuda::RotaryThread<T2, T3, QBits>(p, tracer.mem, bx, tx, n);
    });
    return 0;
  }
};

// The end of a run: the counters into the report, the return code and message (see kv_host_run).
int32_t Finish(int32_t code, const Faults& faults, const TracingMem& mem, KvHostRunReport* report, char* message,
               size_t message_size) {
  report->bytes_read = mem.bytes_read;
  report->bytes_written = mem.bytes_written;
  report->out_of_bounds = faults.out_of_bounds;
  report->misaligned = faults.misaligned;
  report->write_write = faults.write_write;
  report->read_write = faults.read_write;
  if (code != KVCACHE_OP_OK) return code;
  if (faults.Total() == 0) return 0;
  std::string text;
  for (const std::string& f : faults.first) text += f + "\n";
  WriteMessage(text, message, message_size);
  return 4;
}

}  // namespace
}  // namespace kvcache

using namespace kvcache;

extern "C" {

// 0: every launch clean; 1: the call is invalid (message: the validation error, nothing run);
// 4: faults found (message: the first ones). The outputs, cache and scale hold what the threads wrote.
__attribute__((visibility("default"))) int32_t kv_host_run(const KvcacheKeyValueCacheAttrs* attrs,
                                                           const KvcacheTensor inputs[10],
                                                           const KvcacheTensor outputs[2],
                                                           const KvHostRunOptions* options, KvHostRunReport* report,
                                                           char* message, size_t message_size) {
  *report = KvHostRunReport{};
  Faults faults;
  TracingMem mem{};
  mem.faults = &faults;
  const int32_t code = CatchAll(
      [&] {
        const Attrs a = ToAttrs(*attrs);
        TensorArg in[10];
        ToKeyValueCacheArgs(inputs, in);
        const CallPlan plan = ValidateCall(a, in);
        cuda::CheckLaunchable(plan);
        std::vector<int64_t> indices = cuda::PackIndices(plan);  // the "device" copy of the index snapshots
        const cuda::DeviceTensors t{in[0].data, in[1].data, const_cast<void*>(in[8].data),
                                    in[9].present ? const_cast<void*>(in[9].data) : nullptr, outputs[0].data,
                                    outputs[1].data};
        const cuda::Params p = cuda::MakeParams(a, plan, indices.data(), t);
        const int64_t n_starts = 8 * (plan.batch + 1);
        int64_t sizes[cuda::kBufCount] = {
            n_starts, n_starts, 8 * plan.batch, 8 * static_cast<int64_t>(plan.cachestarts.size()),
            TensorBytes(in[0].type, in[0].shape), TensorBytes(in[1].type, in[1].shape),
            TensorBytes(in[8].type, in[8].shape), in[9].present ? TensorBytes(in[9].type, in[9].shape) : 0,
            plan.out_bytes, plan.out_bytes};
        for (int b = 0; b < cuda::kBufCount; ++b) {
          mem.base[b] = static_cast<char*>(p.ptr[b]);
          mem.bytes[b] = options->buffer_bytes[b] >= 0 ? options->buffer_bytes[b] : sizes[b];
        }
        cuda::DispatchTypes(in[0].type, in[9].type, static_cast<int>(a.quant_bit), Runner{p, *options, {mem, *report}});
      },
      message, message_size);
  return Finish(code, faults, mem, report, message, message_size);
}

// The same for KeyCacheRotaryShift's kernel: inputs cache, scale, slots, cos, sin (host memory, written in
// place); options->buffer_bytes may shrink the cache, scale and tables (store_unit / gather_unit unused).
__attribute__((visibility("default"))) int32_t rotary_host_run(const KvcacheRotaryShiftAttrs* attrs,
                                                               const KvcacheTensor inputs[5],
                                                               const KvHostRunOptions* options,
                                                               KvHostRunReport* report, char* message,
                                                               size_t message_size) {
  *report = KvHostRunReport{};
  Faults faults;
  TracingMem mem{};
  mem.faults = &faults;
  const int32_t code = CatchAll(
      [&] {
        RotaryAttrs a;
        TensorArg in[5];
        const RotaryPlan plan = ValidateRotaryWithOutput(attrs, inputs, nullptr, &a, in);
        cuda::CheckRotaryLaunchable(a, plan);
        std::vector<uint8_t> tables = cuda::PackRotaryTables(plan);  // the "device" copy of the snapshots
        const cuda::RotaryParams p = cuda::MakeRotaryParams(a, plan, tables.data(), const_cast<void*>(in[0].data),
                                                            in[1].present ? const_cast<void*>(in[1].data) : nullptr);
        int64_t sizes[cuda::kBufCount] = {};
        sizes[cuda::kCache] = TensorBytes(in[0].type, in[0].shape);
        sizes[cuda::kScale] = in[1].present ? TensorBytes(in[1].type, in[1].shape) : 0;
        sizes[cuda::kSlots] = 8 * static_cast<int64_t>(plan.slots.size());
        sizes[cuda::kCos] = sizes[cuda::kSin] = 4 * static_cast<int64_t>(plan.cos.size());
        for (int b = 0; b < cuda::kBufCount; ++b) {
          mem.base[b] = static_cast<char*>(p.ptr[b]);
          mem.bytes[b] = options->buffer_bytes[b] >= 0 ? options->buffer_bytes[b] : sizes[b];
        }
        cuda::DispatchRotaryTypes(in[0].type, in[1].type, static_cast<int>(a.base.quant_bit),
                                  RotaryRunner{p, {mem, *report}});
      },
      message, message_size);
  return Finish(code, faults, mem, report, message, message_size);
}

}  // extern "C"
