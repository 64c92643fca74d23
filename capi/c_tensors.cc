#include "c_tensors.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "kv_checked.h"

namespace kvcache {

void ToTensorArgs(const KvcacheTensor* tensors, size_t count, const char* const* names, const bool* optional,
                  TensorArg* out) {
  for (size_t i = 0; i < count; ++i) {
    const KvcacheTensor t = tensors[i];  // one read of the caller's descriptor: its rank and shape checked as used
    out[i] = TensorArg{};
    if (t.type == 0) {
      if (!optional[i]) Fail(names[i], " is required (its tensor has type 0)");
      continue;
    }
    if (t.rank < 0 || t.rank > KVCACHE_OP_MAX_RANK)
      Fail(names[i], " has rank ", t.rank, ": the C entry points take ranks 0 to ", KVCACHE_OP_MAX_RANK);
    out[i].present = true;
    out[i].type = t.type;
    out[i].shape.assign(t.shape, t.shape + t.rank);
    out[i].data = t.data;
    for (int64_t d : out[i].shape)
      if (d < 0) Fail(names[i], " has a negative dim in shape ", ShapeStr(out[i].shape));
    int64_t elements = 0;
    if (!CountFits(out[i].shape, &elements)) Fail(names[i], " shape ", ShapeStr(out[i].shape), " has too many elements");
    if (elements > 0 && t.data == nullptr) Fail(names[i], " has ", elements, " elements but its data pointer is NULL");
  }
}

void CheckOutput(const KvcacheTensor& t, const char* name, int32_t type, const std::vector<int64_t>& shape) {
  const std::vector<int64_t> given(t.shape, t.shape + std::clamp<int32_t>(t.rank, 0, KVCACHE_OP_MAX_RANK));
  if (t.type != type || t.rank != static_cast<int32_t>(shape.size()) || given != shape)
    Fail(name, " must be ", ElemName(type), ShapeStr(shape), " (the shape this call produces), got ",
         ElemName(t.type), ShapeStr(given));
  if (t.data == nullptr && TensorBytes(type, shape) > 0) Fail(name, " has a NULL data pointer");
}

int32_t CatchAll(const std::function<void()>& body, char* message, size_t message_size) {
  int32_t code = KVCACHE_OP_OK;
  std::string text;
  try {
    body();
  } catch (const KvError& e) {
    code = KVCACHE_OP_INVALID_ARGUMENT;
    text = e.what();
  } catch (const std::bad_alloc&) {
    code = KVCACHE_OP_RUNTIME_ERROR;
    text = "out of host memory";
  } catch (const std::exception& e) {
    code = KVCACHE_OP_RUNTIME_ERROR;
    text = e.what();
  } catch (...) {
    code = KVCACHE_OP_RUNTIME_ERROR;
    text = "unknown error";
  }
  WriteMessage(text, message, message_size);
  return code;
}

void WriteMessage(const std::string& text, char* message, size_t message_size) {
  if (message == nullptr || message_size == 0) return;
  const size_t n = std::min(text.size(), message_size - 1);
  std::memcpy(message, text.data(), n);
  message[n] = '\0';
}

void ParallelOnThreads(int32_t threads, size_t count, const std::function<void(size_t)>& fn) {
  const size_t workers = std::min<size_t>(count, threads > 1 ? static_cast<size_t>(threads) : 1);
  if (workers <= 1) {
    for (size_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < count;) {
      if (failed.load()) return;
      try {
        fn(i);
      } catch (...) {
        if (!failed.exchange(true)) failure = std::current_exception();
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (size_t w = 1; w < workers; ++w) {
    try {
      pool.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones running (and this one) take the rest of the work
    }
  }
  work();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

const char* const kKeyValueCacheInputs[10] = {"current_key", "current_value", "seqstarts", "kvstarts",
                                              "cachestarts", "start_pos",     "max_seqlen", "max_kvlen",
                                              "cache",       "scale"};

void ToKeyValueCacheArgs(const KvcacheTensor* inputs, TensorArg* out) {
  static const bool optional[10] = {false, false, false, false, false, false, false, false, false, true};
  ToTensorArgs(inputs, 10, kKeyValueCacheInputs, optional, out);
}

Attrs ToAttrs(const KvcacheKeyValueCacheAttrs& c) {
  Attrs a;
  a.num_layer = c.num_layer;
  a.layer_idx = c.layer_idx;
  a.quant_bit = c.quant_bit;
  a.quant_group = c.quant_group;
  a.num_repeat = c.num_repeat;
  a.cache_mode = c.cache_mode;
  a.cache_layout = c.cache_layout;
  a.page_size = c.page_size;
  return a;
}

}  // namespace kvcache
