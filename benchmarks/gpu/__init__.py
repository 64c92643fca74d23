"""The CUDA kernels through the C entry points on torch device memory, against a device copy and
vectorized torch (``bench``, ``torch_baseline``, ``report``)."""
