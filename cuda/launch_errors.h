// The error of one kernel launch. A <<<>>> launch reports its error only through cudaGetLastError, which returns the
// last error of any runtime call on this host thread: an allocation or copy that failed before (its call already
// refused, the cache untouched) would be taken for a later call's launch error after that launch had run, and that
// call would report a failure with its stores done. So an earlier error is dropped right before each launch and the
// error read right after it is the launch's own. An error that breaks the context is sticky and stays: the launch
// fails with it.
#pragma once

#include <cuda_runtime.h>

namespace kvcache {
namespace cuda {

// launch() (one <<<>>> launch) and its error alone.
template <class Launch>
cudaError_t Launched(Launch&& launch) {
  (void)cudaGetLastError();
  launch();
  return cudaGetLastError();
}

// Drops the error a failed runtime call left behind (the call's failure is reported by its caller).
inline void DropError() { (void)cudaGetLastError(); }

}  // namespace cuda
}  // namespace kvcache
