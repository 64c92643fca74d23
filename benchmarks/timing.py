"""What every benchmark shares: the median of repeated calls, and the machine and runtime in words for a
results table."""

import os
import platform
import statistics
import time


def median_seconds(fn, warmup: int, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (the machines are noisy:
    medians, never means)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ort_version() -> str:
    """The onnxruntime version that runs the benchmark."""
    import onnxruntime

    return onnxruntime.__version__


def cpuinfo_fields(cpuinfo: str = None) -> dict:
    """``/proc/cpuinfo``'s fields of its first processor (``cpuinfo``: that file's text), name -> value; empty
    where the file cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(cpuinfo: str = None) -> str:
    """The processor's model name (``/proc/cpuinfo``'s "model name", with "AVX-512" when its flags have
    avx512f); the machine type where that is unknown. A name without a model number (a hypervisor may show only
    "AMD EPYC") gets the CPU family and model, which tell its generations apart (family 25 is Zen 3/4, 26 Zen 5).
    Results of different CPU kinds differ (store kinds, prefetchers, vector width), so every table names the one
    it was measured on."""
    fields = cpuinfo_fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    if not any(c.isdigit() for c in name) and fields.get("cpu family") and fields.get("model"):
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name + (", AVX-512" if "avx512f" in fields.get("flags", "").split() else "")


def cpu_device() -> str:
    """The machine in words, for a results table: processor model and usable cores."""
    return f"CPU {cpu_model()}, {len(os.sched_getaffinity(0))} cores"


def token_prefetch(size: int) -> str:
    """A count of prefetched bytes in words: "<size> B", or "whole rows" for 0."""
    return f"{size} B" if size else "whole rows"


def kernel_build(library: str | None = None) -> str:
    """", <name> kernel build, <plan> stores, <order> cached gathers, <q>/<v> streamed heads a row (quantized/values),
    <n> token streams, quantized token prefetch of <p1>/<p4> (rows of 1/4 KiB; <p> B or whole rows), gather tiles of
    <q0>/<q1>/<q2>/<q3> and <b0>/<b1>/<b2>/<b3> B (quantized and values), <stream|cached> code stores, layout-3 value
    prefetch into <l1|l2>": the KeyValueCache CPU kernel build that runs, how it writes large outputs, how layout 3's
    quantized gathers walk outputs that stay cached, how many heads its layout-3 gathers read side by side into a
    streamed output (quantized caches, unquantized), how many runs of a task's rows its token-order gathers read side
    by side into one, the bytes of a quantized token its token-order gathers ask for ahead, the bytes of the tiles
    its token-order gathers write in layouts 0-3 (quantized caches, unquantized; below a token's row: a token at a
    time), how its stores write quantized codes and which cache level its layout-3 gathers of unquantized rows ask
    for head rows into (``library``: of that build; default the loaded one). Empty for a library of another C API
    version, which the binding refuses."""
    from ..capi import c_api

    def ask(query, *args):
        return query(*args, path=library)

    try:
        prefetch = "/".join(token_prefetch(ask(c_api.cpu_token_prefetch_bytes, row)) for row in (1024, 4096))
        tiles = " and ".join("/".join(str(ask(c_api.cpu_gather_tile_bytes, layout, quant_bit)) for layout in range(4))
                             for quant_bit in (8, 0))
        return (f", {ask(c_api.cpu_kernel)} kernel build, {ask(c_api.cpu_stores)} stores,"
                f" {ask(c_api.cpu_cached_gather)} cached gathers, {ask(c_api.cpu_streamed_heads, 8)}/"
                f"{ask(c_api.cpu_streamed_heads, 0)} streamed heads a row (quantized/values),"
                f" {ask(c_api.cpu_token_streams)} token streams, quantized token prefetch of {prefetch} (rows of 1/4"
                f" KiB), gather tiles of {tiles} B (quantized and values), {ask(c_api.cpu_code_stores)} code stores,"
                f" layout-3 value prefetch into {ask(c_api.cpu_head_prefetch)}")
    except RuntimeError:
        return ""
