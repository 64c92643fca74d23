#include "kv_cuda_run.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention_impl.cuh"
#include "attention_mma_regs.h"
#include "byte_ranges.h"
#include "kv_cache_impl.cuh"
#include "launch_errors.h"
#include "rotary_impl.cuh"
#include "rotary_params.h"

namespace kvcache {
namespace cuda {

namespace {

// Throws for a failed runtime call, its error dropped first: it must not be read again as a later launch's.
void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  DropError();
  throw std::runtime_error(std::string("kvcache-op CUDA: ") + what + ": " + cudaGetErrorString(error));
}

struct ScratchBlock {  // returned to the scratch at scope exit (stream order keeps it alive for the kernels)
  DeviceScratch& scratch;
  void* data;
  ScratchBlock(DeviceScratch& s, size_t bytes) : scratch(s), data(bytes ? s.Alloc(bytes) : nullptr) {}
  ~ScratchBlock() {
    if (data) scratch.Free(data);
  }
};

// A value of the current device, read once per device (read(device, &value) on the first call), not on every call.
// Each caller keeps its own cache (`cache`); 0 means not read yet.
template <class Read>
int CachedPerDevice(std::array<std::atomic<int>, 64>& cache, int device, Read&& read) {
  const bool known = device >= 0 && device < static_cast<int>(cache.size());
  int value = known ? cache[device].load(std::memory_order_relaxed) : 0;
  if (value == 0) {
    read(device, &value);
    if (known) cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

// A device attribute, read from the driver once per device.
template <cudaDeviceAttr Attr>
int CachedAttribute(int device, const char* what) {
  static std::array<std::atomic<int>, 64> cache{};
  return CachedPerDevice(cache, device, [&](int d, int* v) { Check(cudaDeviceGetAttribute(v, Attr, d), what); });
}

// Whether the tensor-core kernels can run on the device in `form` (1 or 2): products compiled for sm_80 or newer
// (a build without sm_80 code would reach their trap), and their shared memory within the device's per-block limit
// (form 1's 113 KB exceeds the 99 KB of sm_86, sm_89 and sm_120; form 2's fits every sm_80 GPU).
bool MmaKernelRuns(int device, int form) {
  static std::array<std::atomic<int>, 64> versions{};
  const int major = CachedAttribute<cudaDevAttrComputeCapabilityMajor>(device, "reading the compute capability");
  if (major < 8) return false;
  const int ptx = CachedPerDevice(versions, device, [](int, int* v) {
    Check(MmaKernelPtxVersion(v), "reading the tensor-core kernel's architecture");
  });
  const int shared = CachedAttribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(
      device, "reading the shared memory a block may have");
  return ptx >= 80 && shared >= (form == 2 ? kMmaRegSharedBytes : kMmaSharedBytes);
}

bool EnvIs(const char* name, const char* value) {
  const char* set = std::getenv(name);
  return set != nullptr && std::string(set) == value;
}

// The planner's policy on the current device for a call of element type t1 (and scale_type, the ONNX type of a
// quantized cache's scale; 0 without) over these tensors: about four tile blocks (eight decode blocks) per
// multiprocessor.
TilePolicy DevicePolicy(int32_t t1, int32_t scale_type, const AttnTensors& tensors, const CacheSide* cache) {
  int device = 0;
  Check(cudaGetDevice(&device), "reading the current device");
  const int sms = CachedAttribute<cudaDevAttrMultiProcessorCount>(device, "reading the multiprocessor count");
  TilePolicy policy;
  policy.min_blocks = 4 * int64_t(sms > 0 ? sms : 1);
  policy.min_decode_blocks = 2 * policy.min_blocks;
  // Decodes (sequences of one token), measured on an H200 (benchmarks/gpu/attention_h200_staged; device time per
  // call): the staged decode kernel beats the tile kernel on every shape measured, 1.09-1.32x (B=64 x 1,024 keys 8/2
  // heads: 0.079 against 0.087 ms; B=32 x 2,048 32/8: 0.272 against 0.347; MultiHeadAttention's packed B=64: 0.062
  // against 0.081), and the first decode kernel and the tensor-core kernel lose to both. So decodes take the staged
  // kernel where float16 / bfloat16 rows as stored fit it (16-byte aligned), else the tile kernel. Its quantized
  // form (int8 / int4 codes staged with their scales) is not measured on a GPU yet, so a quantized cache takes it
  // only with KVCACHE_OP_CUDA_DECODE_KERNEL=2 (where StagedRowsFit). KVCACHE_OP_CUDA_DECODE_KERNEL=0 sends every
  // decode to the tile kernel, =1 to the first decode kernel, and KVCACHE_OP_CUDA_MMA_DECODE=1 to the tensor-core
  // kernel. Longer float16 / bfloat16 sequences take the tensor-core kernel (a B=8 x 1,024-row prefill, 32/8 heads,
  // on an H100: 3.57 ms against 9.48 in the tile kernel) unless KVCACHE_OP_CUDA_MMA=0. All are read on every call:
  // tests and benchmarks switch them.
  // KVCACHE_OP_CUDA_DECODE_KERNEL=3 sends them (quantized too) to the staged kernel's second form, every head of a
  // tile in each thread's registers (attention_decode_staged.h), not measured on a GPU yet.
  const bool first_form = EnvIs("KVCACHE_OP_CUDA_DECODE_KERNEL", "1");
  const bool heads_form = EnvIs("KVCACHE_OP_CUDA_DECODE_KERNEL", "3");
  const bool quantized = cache != nullptr && cache->attrs->quant_bit != 0;
  const bool staged = !first_form && !EnvIs("KVCACHE_OP_CUDA_DECODE_KERNEL", "0") &&
                      (!quantized || heads_form || EnvIs("KVCACHE_OP_CUDA_DECODE_KERNEL", "2")) &&
                      StagedRowsFit(t1, scale_type, tensors, cache);
  policy.decode_kernel = first_form || staged;
  policy.decode_form = staged ? (heads_form ? 3 : 2) : 1;
  policy.mma_decode = EnvIs("KVCACHE_OP_CUDA_MMA_DECODE", "1");
  // The second form is not measured on a GPU yet. A quantized call asking for it takes the first (MmaFormFor), and
  // the shared memory checked below is that form's.
  policy.mma_form = MmaFormFor(EnvIs("KVCACHE_OP_CUDA_MMA", "2") ? 2 : 1, cache);
  policy.mma_kernel = !EnvIs("KVCACHE_OP_CUDA_MMA", "0") && MmaRowsFit(t1, tensors, cache) &&
                      MmaKernelRuns(device, policy.mma_form);
  return policy;
}

// A planned attention launch's device scratch: its index and tile words and the split parts' records, allocated
// before anything of the call is enqueued (a call whose scratch cannot be had writes nothing, the cache included).
struct PlannedScratch {
  ScratchBlock words, partials;
  PlannedScratch(DeviceScratch& scratch, const AttnLaunchPlan& launch, int64_t head_dim)
      : words(scratch, launch.words.size() * sizeof(int64_t)),
        partials(scratch, static_cast<size_t>(launch.records * (head_dim + 2)) * sizeof(float)) {}
};

// A planned attention call made ready to launch: its words (index inputs, tiles, merges, and MultiHeadCacheAttention's
// stores' index inputs) copied to the device in one transfer and the tensor-core kernel granted its shared memory.
// Everything of the call that may fail short of the launches, so MultiHeadCacheAttention does it before its stores
// are enqueued. Empty for a call with no tiles.
struct StagedAttention {
  std::optional<AttnParams> params;
  int32_t t1, scale_type;
  int quant_bit;
  bool cache;
};

StagedAttention StagePlanned(const MhaAttrs& a, const MhaPlan& plan, const CacheSide* cache,
                             const AttnLaunchPlan& launch, int32_t t1, int32_t scale_type, int quant_bit,
                             const AttnTensors& tensors, cudaStream_t stream, PlannedScratch& scratch) {
  StagedAttention staged{std::nullopt, t1, scale_type, quant_bit, cache != nullptr};
  if (!launch.words.empty())
    Check(cudaMemcpyAsync(scratch.words.data, launch.words.data(), launch.words.size() * sizeof(int64_t),
                          cudaMemcpyHostToDevice, stream),
          "copying the index inputs and the tiles");
  if (launch.tiles + launch.decode_tiles + launch.mma_tiles == 0) return staged;
  staged.params = MakeAttnParams(a, plan, cache, launch, tensors, static_cast<const int64_t*>(scratch.words.data),
                                 static_cast<float*>(scratch.partials.data));
  Check(LaunchAttention(*staged.params, t1, scale_type, quant_bit, staged.cache, stream, AttnStep::kPrepare),
        "granting the tensor-core kernel its shared memory");
  return staged;
}

void LaunchStaged(const StagedAttention& staged, cudaStream_t stream) {
  if (!staged.params) return;
  Check(LaunchAttention(*staged.params, staged.t1, staged.scale_type, staged.quant_bit, staged.cache, stream,
                        AttnStep::kLaunch),
        "launching the attention kernels");
}

// The kernels read every element with its own type's width: a device pointer off that alignment would fault, so
// such a call is refused by name before anything is enqueued.
void CheckAligned(const char* name, const void* data, int32_t type) {
  if (data == nullptr) return;
  const int64_t width = TensorBytes(type, {1});
  if (reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(width) != 0)
    Fail(name, " must be aligned to its ", width, "-byte elements on CUDA, got address ", data);
}

void CheckAttentionAligned(const AttnTensors& t, int32_t t1) {
  for (auto [name, data] : {std::pair<const char*, const void*>{"query", t.query}, {"key", t.key}, {"value", t.value},
                            {"attn_mask", t.mask}, {"output", t.out}})
    CheckAligned(name, data, t1);
}

}  // namespace

void RefuseGraphCapture(cudaStream_t stream, const char* op) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  Check(cudaStreamIsCapturing(stream, &status), "reading the stream's capture status");
  if (status != cudaStreamCaptureStatusNone)
    Fail(op, " on CUDA cannot be captured into a CUDA graph: every call copies its validated indices from host "
         "memory and sizes its launches by them, so a replay would repeat the captured step's slots (run it "
         "outside stream capture; in ONNX Runtime, without the CUDA EP's enable_cuda_graph)");
}

void RunAttentionValidated(const MhaAttrs& a, const MhaPlan& plan, int32_t t, const AttnTensors& tensors,
                           cudaStream_t stream, DeviceScratch& scratch) {
  CheckAttentionAligned(tensors, t);
  RefuseGraphCapture(stream, "MultiHeadAttention");
  const AttnLaunchPlan launch = PlanAttention(a, plan, nullptr, DevicePolicy(t, 0, tensors, nullptr));  // throws first
  PlannedScratch planned(scratch, launch, a.head_dim);
  LaunchStaged(StagePlanned(a, plan, nullptr, launch, t, 0, 0, tensors, stream, planned), stream);
}

void RunCacheAttentionValidated(const MhcaAttrs& a, const MhcaPlan& plan, int32_t t1, int32_t scale_type,
                                const void* key, const void* value, const AttnTensors& tensors, cudaStream_t stream,
                                DeviceScratch& scratch) {
  const CacheSide side{&a.cache, &plan.cache};
  // Everything checked and allocated before anything is enqueued: a call that cannot run leaves the cache unchanged.
  CheckAttentionAligned(tensors, t1);
  CheckAligned("current_key", key, t1);
  CheckAligned("current_value", value, t1);
  CheckAligned("cache", tensors.cache, a.cache.quant_bit ? int32_t(Elem::kInt8) : t1);
  if (a.cache.quant_bit) CheckAligned("scale", tensors.scale, scale_type);  // read only when quantized
  if (plan.cache.batch > 0) CheckLaunchable(plan.cache);
  RefuseGraphCapture(stream, "MultiHeadCacheAttention");
  AttnLaunchPlan launch =
      PlanAttention(a.attention, plan.attention, &side, DevicePolicy(t1, scale_type, tensors, &side));
  // The stores' index inputs travel with the attention's words: one copy to the device.
  const int64_t stores_at = AppendStoreIndices(plan.cache, &launch);
  PlannedScratch planned(scratch, launch, a.attention.head_dim);
  const StagedAttention attention = StagePlanned(a.attention, plan.attention, &side, launch, t1, scale_type,
                                                 static_cast<int>(a.cache.quant_bit), tensors, stream, planned);
  if (stores_at >= 0) {
    const DeviceTensors rows{key, value, const_cast<void*>(tensors.cache), const_cast<void*>(tensors.scale), nullptr,
                             nullptr};
    const Params p =
        MakeParams(a.cache, plan.cache, static_cast<const int64_t*>(planned.words.data) + stores_at, rows);
    Check(LaunchKeyValueStores(p, t1, scale_type, static_cast<int>(a.cache.quant_bit), stream), "launching the stores");
  }
  LaunchStaged(attention, stream);
}

void RunValidated(const Attrs& a, const CallPlan& plan, int32_t t1, int32_t scale_type, const DeviceTensors& t,
                  cudaStream_t stream, DeviceScratch& scratch) {
  if (plan.batch == 0) return;
  // Before anything is enqueued: a call that cannot run leaves the cache unchanged.
  for (auto [name, data] : {std::pair<const char*, const void*>{"current_key", t.key}, {"current_value", t.value},
                            {"output key", t.out_key}, {"output value", t.out_value}})
    CheckAligned(name, data, t1);
  CheckAligned("cache", t.cache, a.quant_bit ? int32_t(Elem::kInt8) : t1);
  if (a.quant_bit) CheckAligned("scale", t.scale, scale_type);  // read only when quantized
  CheckLaunchable(plan);
  RefuseGraphCapture(stream, "KeyValueCache");
  // One host buffer with every index array (the plan's snapshots), copied to the device once. A pageable
  // source is staged by the driver before cudaMemcpyAsync returns, so `host` may go out of scope after.
  const std::vector<int64_t> host = PackIndices(plan);
  ScratchBlock indices(scratch, host.size() * sizeof(int64_t));
  Check(cudaMemcpyAsync(indices.data, host.data(), host.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream),
        "copying the index inputs");
  const Params p = MakeParams(a, plan, static_cast<const int64_t*>(indices.data), t);
  Check(LaunchKeyValueCache(p, t1, scale_type, static_cast<int>(a.quant_bit), stream), "launching the kernels");
}

void RunRotaryValidated(const RotaryAttrs& a, const RotaryPlan& plan, int32_t cache_type, int32_t scale_type,
                        void* cache, void* scale, cudaStream_t stream, DeviceScratch& scratch, int64_t* slots_out) {
  if (plan.slots.empty()) return;
  CheckAligned("cache", cache, cache_type);  // before anything is enqueued
  if (a.base.quant_bit) CheckAligned("scale", scale, scale_type);
  CheckRotaryLaunchable(a, plan);
  RefuseGraphCapture(stream, "KeyCacheRotaryShift");
  // A pageable source is staged by the driver before cudaMemcpyAsync returns: the plan may go.
  if (slots_out)
    Check(cudaMemcpyAsync(slots_out, plan.slots.data(), plan.slots.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                          stream),
          "copying slots_out");
  const std::vector<uint8_t> host = PackRotaryTables(plan);
  ScratchBlock tables(scratch, host.size());
  Check(cudaMemcpyAsync(tables.data, host.data(), host.size(), cudaMemcpyHostToDevice, stream),
        "copying the slots and rotation tables");
  const RotaryParams p = MakeRotaryParams(a, plan, static_cast<const uint8_t*>(tables.data), cache, scale);
  Check(LaunchRotaryShift(p, cache_type, scale_type, static_cast<int>(a.base.quant_bit), stream), "launching the kernel");
}

}  // namespace cuda
}  // namespace kvcache
