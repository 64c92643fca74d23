"""CUDA benchmark of the attention kernels (MultiHeadCacheAttention and MultiHeadAttention through the C entry
points): the op's time, its cache-read bandwidth against a device copy, and torch's scaled_dot_product_attention
on a padded batch of the same shapes, measured side by side in one run on one CUDA stream.

    python -m kvcache_op.benchmarks.gpu.attention --out DIR
    python -m kvcache_op.benchmarks.gpu.attention --quick     # tiny shapes: a smoke run

Needs a CUDA GPU, torch with CUDA (device memory, streams, events) and a build of the library with its CUDA
kernels; without one of them it exits with status 2 and one line saying what is missing.

Cases (float16 unless said; head_dim 128; cache pages of 16 slots):

* decode, MultiHeadCacheAttention: B=64 kvlen 1024, 8 query heads over 2 kv heads, layouts 0 and 3; B=32 kvlen
  2048, 32 over 8 heads, layouts 0 and 3, without quantization and int8 (quant_group 8, float16 scales). Each
  call stores the step's key and value (one token per sequence), then attends over the cache;
* decode, MultiHeadAttention on packed keys and values: B=64 kvlen 1024, 8 over 2 heads;
* prefill, MultiHeadAttention: B=8 seqlen 1024, 32 over 8 heads, causal.

Figures, per case:

* **op ms**: the op through the C entry point (index upload, stores, attention, merges), CUDA events around each
  call, after a warm-up, median of the repeats (as ``kvcache_op.benchmarks.gpu.bench`` times);
* **bytes read**: the keys and values the op reads, as stored: B x kvlen x Hkv x Dh x 2 (K and V) x sizeof(cache
  element) [+ B x kvlen x Hkv x Dh / quant_group x 2 x sizeof(scale), int8]; for MultiHeadAttention the packed
  key and value tensors. Queries, outputs, index inputs and stores are not counted; each key is counted once
  (prefill tiles read keys more than once);
* **copy ms**: ``copy_`` of a tensor of that many bytes, device to device (it reads those bytes and writes as
  many); measured before and after the op, the faster kept. **op / copy** = copy ms / op ms (decode targets:
  0.7, int8 0.6; a prefill is bound by arithmetic, not by these bytes). **read GB/s** = bytes read / op ms;
  **copy GB/s** = 2 x bytes / copy ms (read and written); **of copy bandwidth** = read GB/s / copy GB/s, half of
  op / copy: the op only reads its bytes where the copy reads and writes them, so an op reading at the copy's rate
  shows 2.0x op / copy and 1.0 of its bandwidth;
* **sdpa ms**: ``torch.nn.functional.scaled_dot_product_attention`` on contiguous padded tensors of the same
  shapes (decode: query [B, H, 1, Dh], keys and values [B, Hkv, kvlen, Dh]; prefill: [B, H|Hkv, S, Dh],
  ``is_causal=True``, the flash backend through ``torch.nn.attention.sdpa_kernel`` when it runs), GQA by
  ``enable_gqa=True`` or, where that is refused, keys expanded to H heads before timing. **vs sdpa** = sdpa ms /
  op ms (above 1: the op is faster; prefill target 0.8). For MultiHeadAttention the two get the same numbers:
  **max |op - sdpa|** is their largest difference (a sanity figure);
* decodes of float16 / bfloat16 rows as stored (packed, unquantized caches) take the staged decode kernel by
  default (rows copied into shared memory with cp.async), others the tile kernel; rows ending **decode kernel** /
  **tile kernel** / **tensor-core kernel** on a decode: sequences of one token through the first decode kernel
  (``KVCACHE_OP_CUDA_DECODE_KERNEL=1``), the tile kernel (``=0``) or the tensor-core kernel
  (``KVCACHE_OP_CUDA_MMA_DECODE=1``) instead of the default, on shapes measured above; **staged decode kernel** on
  an int8 decode: its codes and scales staged (``KVCACHE_OP_CUDA_DECODE_KERNEL=2``), beside the default tile
  kernel's row of the same shape; **staged decode kernel, heads in registers**: its second form
  (``KVCACHE_OP_CUDA_DECODE_KERNEL=3``: each thread holds every head of its tile, so a staged row is converted once
  for the tile's four heads), on float16 and int8 decodes; **tile kernel** on a
  prefill: through the tile kernel
  (``KVCACHE_OP_CUDA_MMA=0``) instead of the tensor-core kernel, the default for float16 and bfloat16; **tensor-core
  kernel in registers**: its second form (``KVCACHE_OP_CUDA_MMA=2``; built for unquantized rows only, so int8 and
  int4 caches keep the first), on a decode with ``KVCACHE_OP_CUDA_MMA_DECODE=1`` too: each tile's query heads of one
  kv head (4 of warp 0's 16 rows at GQA 4) through m16n8k16 products over chunks of 64 keys. Its lanes' loop over a
  chunk is 5,300 PTX instructions (sm_90, rare paths included) where the staged decode kernel's over the same 64 keys
  is 6,100, at half the warps per multiprocessor: the row says whether tensor cores pay on a decode;
* **ran**: a row naming a route is checked against the attention kernels torch's profiler saw it launch: a row whose
  kernel did not run (the library took another route) says so, and the run exits 1. A case that fails (a route never
  run on this GPU, say) has its error as its row, the others are measured, and the run exits 1; after an error that
  loses the CUDA context (an illegal address: every later call would fail) the remaining cases are listed as not
  run. results.md and results.json are rewritten after every case, so a run stopped part way keeps the rows before.
"""

import argparse
import dataclasses
import sys

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ..environment import environment, recorded_command

QUANT_GROUP = 8
SCALE_TYPE = "float16"
DEVICE = "cuda"
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
#: op / copy targets of the decodes (int8 lower: its scales and the dequantization) and the prefill vs-sdpa target.
COPY_TARGET = {0: 0.7, 8: 0.6}
SDPA_TARGET = {"prefill": 0.8}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # "mhca" (MultiHeadCacheAttention) or "mha" (MultiHeadAttention)
    phase: str  # "decode" (one query per sequence, every sequence decoding) or "prefill" (causal, S = kvlen)
    batch: int
    seqlen: int
    kvlen: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    dtype: str = "float16"
    quant_bit: int = 0  # 0 or 8 (MultiHeadCacheAttention)
    layout: int = 0
    page_size: int = 16
    kernel: str = ""  # "": the default route; else the route KERNELS names (its environment variable)

    @property
    def op_name(self) -> str:
        return "MultiHeadCacheAttention" if self.op == "mhca" else "MultiHeadAttention"

    def label(self) -> str:
        size = f"S={self.seqlen}" if self.phase == "prefill" else f"kvlen={self.kvlen}"
        cache = f" q{self.quant_bit} L{self.layout} page={self.page_size}" if self.op == "mhca" else " packed"
        kernel = f" {KERNELS[self.kernel][0]}" if self.kernel else ""
        return (f"{self.op} {self.phase} B={self.batch} {size} H={self.heads}/{self.kv_heads} Dh={self.head_dim} "
                f"{self.dtype}{cache}{kernel}")

    def bytes_read(self) -> int:
        """Bytes of the keys and values the op reads, as stored (see the module's notes)."""
        elements = self.batch * self.kvlen * self.kv_heads * self.head_dim * 2
        if self.op == "mha" or not self.quant_bit:
            return elements * ITEMSIZE[self.dtype]
        return elements + elements // QUANT_GROUP * ITEMSIZE[SCALE_TYPE]  # int8 codes and their scales


def cases(quick: bool) -> list:
    """The measured cases (the module's notes); ``quick``: the same mix, tiny (a smoke run, measures nothing)."""
    if quick:
        return ([Case("mhca", "decode", 4, 1, 64, 4, 2, head_dim=64, layout=layout) for layout in (0, 3)]
                + [Case("mhca", "decode", 4, 1, 96, 4, 2, head_dim=64, quant_bit=8, layout=3, kernel=k)
                   for k in ("", "staged")]
                + [Case("mhca", "decode", 4, 1, 64, 4, 2, head_dim=64, kernel=k)
                   for k in ("decode", "tile-decode", "mma", "mma2-decode", "heads")]
                + [Case("mha", "decode", 4, 1, 64, 4, 2, head_dim=64),
                   Case("mha", "prefill", 2, 64, 64, 4, 2, head_dim=64),
                   Case("mha", "prefill", 2, 64, 64, 4, 2, head_dim=64, kernel="tile"),
                   Case("mha", "prefill", 2, 64, 64, 4, 2, head_dim=64, kernel="mma2")])
    out = [Case("mhca", "decode", 64, 1, 1024, 8, 2, layout=layout) for layout in (0, 3)]
    out += [Case("mhca", "decode", 32, 1, 2048, 32, 8, quant_bit=q, layout=layout) for q in (0, 8) for layout in (0, 3)]
    out += [Case("mha", "decode", 64, 1, 1024, 8, 2), Case("mha", "prefill", 8, 1024, 1024, 32, 8)]
    out += [Case("mha", "prefill", 8, 1024, 1024, 32, 8, dtype="bfloat16"),
            Case("mhca", "prefill", 8, 1024, 1024, 32, 8), Case("mhca", "prefill", 8, 1024, 1024, 32, 8, quant_bit=8)]
    # the other routes beside the defaults on the same shapes: decodes through the decode kernel and through the
    # tensor-core kernel, the prefill through the tile kernel
    out += [Case("mhca", "decode", 64, 1, 1024, 8, 2, kernel=k) for k in ("decode", "mma")]
    # the tile kernel on every unquantized decode shape above, which the staged decode kernel takes by default
    out += [Case("mhca", "decode", 64, 1, 1024, 8, 2, layout=layout, kernel="tile-decode") for layout in (0, 3)]
    out += [Case("mhca", "decode", 32, 1, 2048, 32, 8, layout=layout, kernel="tile-decode") for layout in (0, 3)]
    out += [Case("mha", "decode", 64, 1, 1024, 8, 2, kernel="tile-decode")]
    out += [Case("mhca", "decode", 32, 1, 2048, 32, 8, quant_bit=8, kernel=k) for k in ("decode", "mma")]
    out += [Case("mha", "prefill", 8, 1024, 1024, 32, 8, kernel="tile")]
    # the routes not yet run on a GPU come last, so that a failing one cannot cost the rows above: the staged decode
    # kernel on the int8 decodes (codes and scales staged; not the default until measured)
    out += [Case("mhca", "decode", 32, 1, 2048, 32, 8, quant_bit=8, layout=layout, kernel="staged")
            for layout in (0, 3)]
    # the tensor-core kernel's second form (products in registers) on the prefills
    out += [Case("mha", "prefill", 8, 1024, 1024, 32, 8, kernel="mma2"),
            Case("mhca", "prefill", 8, 1024, 1024, 32, 8, kernel="mma2")]
    # the staged decode kernel's second form (every head of a tile in a thread's registers), float16 and int8
    out += [Case("mhca", "decode", 64, 1, 1024, 8, 2, kernel="heads"),
            Case("mhca", "decode", 32, 1, 2048, 32, 8, kernel="heads"),
            Case("mhca", "decode", 32, 1, 2048, 32, 8, quant_bit=8, kernel="heads"),
            Case("mha", "decode", 64, 1, 1024, 8, 2, kernel="heads")]
    # the tensor-core kernel's second form on the unquantized decodes (with the staged decode kernel's default rows)
    out += [Case("mhca", "decode", 64, 1, 1024, 8, 2, kernel="mma2-decode"),
            Case("mhca", "decode", 32, 1, 2048, 32, 8, kernel="mma2-decode"),
            Case("mha", "decode", 64, 1, 1024, 8, 2, kernel="mma2-decode")]
    return out


#: A case's route: (its label, the environment the library reads on every call). The default: sequences of one token
#: through the staged decode kernel where their rows fit it (else the tile kernel), longer float16 / bfloat16 ones
#: through the tensor-core kernel.
KERNELS = {
    "": ("", {}),
    "decode": ("decode kernel", {"KVCACHE_OP_CUDA_DECODE_KERNEL": "1"}),
    "tile-decode": ("tile kernel", {"KVCACHE_OP_CUDA_DECODE_KERNEL": "0"}),
    "staged": ("staged decode kernel", {"KVCACHE_OP_CUDA_DECODE_KERNEL": "2"}),
    "heads": ("staged decode kernel, heads in registers", {"KVCACHE_OP_CUDA_DECODE_KERNEL": "3"}),
    "mma": ("tensor-core kernel", {"KVCACHE_OP_CUDA_MMA_DECODE": "1"}),
    "tile": ("tile kernel", {"KVCACHE_OP_CUDA_MMA": "0"}),
    "mma2": ("tensor-core kernel in registers", {"KVCACHE_OP_CUDA_MMA": "2"}),
    "mma2-decode": ("tensor-core kernel in registers", {"KVCACHE_OP_CUDA_MMA": "2", "KVCACHE_OP_CUDA_MMA_DECODE": "1"}),
}
#: The attention kernel a route's rows must launch (as :func:`short_name` names it); the default route is the library's
#: choice, not checked.
ROUTE_KERNELS = {"decode": "DecodeKernel", "tile-decode": "TileKernel", "staged": "StagedDecodeKernel",
                 "heads": "StagedDecodeKernel, heads in registers", "mma": "MmaKernel", "tile": "TileKernel",
                 "mma2": "MmaRegKernel", "mma2-decode": "MmaRegKernel"}
ATTENTION_KERNELS = frozenset(ROUTE_KERNELS.values())  # every route names one; together they are all of them
ROUTE_VARIABLES = ("KVCACHE_OP_CUDA_DECODE_KERNEL", "KVCACHE_OP_CUDA_MMA", "KVCACHE_OP_CUDA_MMA_DECODE")


def kernel_route(kernel: str):
    """The route ``kernel`` (KERNELS) set inside, every other route variable unset; the environment restored after."""
    return environment({**dict.fromkeys(ROUTE_VARIABLES), **KERNELS[kernel][1]})


def missing_requirements() -> list:
    """What this machine lacks, one phrase each (empty: nothing): the CUDA benchmark's requirements."""
    from .bench import missing_requirements as kv_missing

    return kv_missing()


def index_arrays(case: Case, rng) -> tuple:
    """A case's host index inputs (int64 numpy arrays by input name) and, MultiHeadCacheAttention, the slots its cache
    holds (0 for MultiHeadAttention): every sequence ``seqlen`` queries over ``kvlen`` keys, and a cache's pages
    handed out in a random order from one more page than the sequences need."""
    B, S, K = case.batch, case.seqlen, case.kvlen
    index = {"seqstarts": np.arange(B + 1, dtype=np.int64) * S, "kvstarts": np.arange(B + 1, dtype=np.int64) * K,
             "decoding_batches": np.array(B if case.phase == "decode" else 0, np.int64),
             "max_seqlen": np.array(S, np.int64), "max_kvlen": np.array(K, np.int64)}
    if case.op != "mhca":
        return index, 0
    pages = -(-K // case.page_size)
    table = rng.permutation(B * pages + 1)[:B * pages].reshape(B, pages).astype(np.int64) * case.page_size
    index.update(cachestarts=table, start_pos=np.full(B, K - S, np.int64))
    return index, (B * pages + 1) * case.page_size


class AttentionCall:
    """One case's op call on torch device memory (seeded): its tensors, their C descriptions, the host index
    arrays (kept alive here), and the same shapes padded for torch's SDPA."""

    def __init__(self, case: Case, seed: int = 0):
        import torch

        from ...capi import c_api
        from ...reference import cache_shape
        from ...reference.dtypes import BFLOAT16

        self.case = case
        rng = np.random.default_rng(seed)
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        value_t = getattr(torch, case.dtype)
        value_np = BFLOAT16 if case.dtype == "bfloat16" else np.dtype(case.dtype)
        B, S, K, H, Hkv, D = case.batch, case.seqlen, case.kvlen, case.heads, case.kv_heads, case.head_dim
        tokens = B * S

        def randn(*shape):
            return torch.randn(shape, generator=g, device=DEVICE, dtype=value_t)

        def described(t, dtype):
            return c_api.Tensor(c_api.onnx_type(dtype), tuple(t.shape), t.data_ptr()) if t is not None else c_api.ABSENT

        self.host = c_api.HostBuffers()
        self.query = randn(tokens, H, D)
        self.out = torch.empty_like(self.query)
        index, max_t = index_arrays(case, rng)
        self.attributes = dict(num_heads=H, head_dim=D, num_kv_heads=Hkv, is_causal=1)
        if case.op == "mhca":
            self.current = [randn(tokens, Hkv, D) for _ in range(2)]
            dims = cache_shape(case.layout, 1, max_t, Hkv, D)
            if case.quant_bit:
                self.cache = torch.randint(-127, 128, dims, generator=g, device=DEVICE, dtype=torch.int8)
                self.scale = torch.empty(cache_shape(case.layout, 1, max_t, Hkv, D // QUANT_GROUP), device=DEVICE,
                                         dtype=getattr(torch, SCALE_TYPE)).uniform_(0.001, 0.02, generator=g)
            else:
                self.cache, self.scale = randn(*dims), None
            by_name = {"query": described(self.query, value_np), "current_key": described(self.current[0], value_np),
                       "current_value": described(self.current[1], value_np),
                       "cache": described(self.cache, np.int8 if case.quant_bit else value_np),
                       "scale": described(self.scale, np.dtype(SCALE_TYPE)), "attn_mask": c_api.ABSENT}
            names, self._run = c_api.MHCA_INPUTS, c_api.run_multi_head_cache_attention
            self.attributes.update(quant_bit=case.quant_bit, quant_group=QUANT_GROUP, cache_mode=1,
                                   cache_layout=case.layout, page_size=case.page_size)
            # SDPA's keys and values: contiguous padded tensors of the same shapes (not the cache's bytes)
            self.sdpa_kv = [randn(B, Hkv, K, D) for _ in range(2)]
        else:
            self.key, self.value = randn(B * K, Hkv, D), randn(B * K, Hkv, D)
            by_name = {"query": described(self.query, value_np), "key": described(self.key, value_np),
                       "value": described(self.value, value_np), "attn_mask": c_api.ABSENT}
            names, self._run = c_api.MHA_INPUTS, c_api.run_multi_head_attention
            self.sdpa_kv = [t.view(B, K, Hkv, D).transpose(1, 2).contiguous() for t in (self.key, self.value)]
        self.inputs = [by_name[n] if n in by_name else self.host.tensor(n, index[n]) for n in names]
        self.output = described(self.out, value_np)
        self.sdpa_query = self.query.view(B, S, H, D).transpose(1, 2).contiguous()
        self.stream = torch.cuda.current_stream().cuda_stream

    def run_op(self) -> None:
        """Enqueues the op on the stream that was current at construction; does not wait for it."""
        self._run(self.inputs, self.output, device="cuda", stream=self.stream, **self.attributes)

    def op_as_sdpa(self):
        """The op's output in SDPA's [B, H, S, Dh] order."""
        c = self.case
        return self.out.view(c.batch, c.seqlen, c.heads, c.head_dim).transpose(1, 2)

    def sdpa(self):
        """(backend label, a function enqueuing SDPA): the first form that runs, in order: flash (prefill) with
        enable_gqa, flash with keys expanded, the default choice with enable_gqa, the default with keys expanded."""
        import torch

        F = torch.nn.functional.scaled_dot_product_attention
        q, (k, v) = self.sdpa_query, self.sdpa_kv
        group = self.case.heads // self.case.kv_heads
        causal = self.case.phase == "prefill"
        expanded = None

        def kv_expanded():
            nonlocal expanded
            if expanded is None:
                expanded = [t.repeat_interleave(group, dim=1).contiguous() for t in (k, v)] if group > 1 else [k, v]
            return expanded

        def form(flash, gqa):
            def run():
                keys, values = (k, v) if gqa else kv_expanded()
                extra = {"enable_gqa": True} if gqa and group > 1 else {}
                if flash:
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F(q, keys, values, is_causal=causal, **extra)
                return F(q, keys, values, is_causal=causal, **extra)
            return run

        forms = ([("flash", form(True, True)), ("flash, keys expanded", form(True, False))] if causal else [])
        forms += [("default", form(False, True)), ("default, keys expanded", form(False, False))]
        errors = []
        for label, fn in forms:
            try:
                fn()
                torch.cuda.current_stream().synchronize()
                return label, fn
            except (RuntimeError, TypeError, ImportError) as error:  # a backend or argument this torch lacks
                errors.append(f"{label}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
        raise RuntimeError("scaled_dot_product_attention ran in no form: " + "; ".join(errors))


def measure(case: Case, warmup: int, repeats: int) -> dict:
    """One row: op, copy and SDPA times of ``case``, back to back on the current stream."""
    with kernel_route(case.kernel):
        return _measure(case, warmup, repeats)


def _measure(case: Case, warmup: int, repeats: int) -> dict:
    import torch

    from .bench import host_ms, kernel_ms

    call = AttentionCall(case)
    nbytes = int(case.bytes_read())
    src = torch.ones(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    backend, sdpa = call.sdpa()
    copy_ms = kernel_ms(copy, warmup, repeats)
    op_ms = kernel_ms(call.run_op, warmup, repeats)
    sdpa_ms = kernel_ms(sdpa, warmup, repeats)
    copy_ms = min(copy_ms, kernel_ms(copy, warmup, repeats))  # the copy measured around the op, same run
    host = host_ms(call.run_op, warmup, repeats, idle=True)  # validation, planning, enqueueing alone
    breakdown = device_breakdown(call.run_op)
    diff = None
    if case.op == "mha":  # the same numbers: a sanity figure
        call.run_op()
        want = sdpa()
        torch.cuda.current_stream().synchronize()
        diff = float((call.op_as_sdpa().float() - want.float()).abs().max())
    return {
        "op": case.op, "phase": case.phase, "B": case.batch, "seqlen": case.seqlen, "kvlen": case.kvlen,
        "H": case.heads, "Hkv": case.kv_heads, "Dh": case.head_dim, "dtype": case.dtype, "quant_bit": case.quant_bit,
        "layout": case.layout if case.op == "mhca" else None,
        "page_size": case.page_size if case.op == "mhca" else None,
        "label": case.label(), "bytes_read": nbytes, "op_ms": op_ms, "copy_ms": copy_ms, "sdpa_ms": sdpa_ms,
        "sdpa_backend": backend, "read_GBps": nbytes / op_ms / 1e6, "copy_GBps": 2 * nbytes / copy_ms / 1e6,
        "vs_copy": copy_ms / op_ms, "copy_bandwidth_fraction": copy_ms / op_ms / 2, "vs_sdpa": sdpa_ms / op_ms,
        "copy_target": COPY_TARGET.get(case.quant_bit) if case.phase == "decode" else None,
        "sdpa_target": SDPA_TARGET.get(case.phase),
        "max_abs_diff_vs_sdpa": diff, "host_ms": host, "device_breakdown": breakdown,
        **route_check(case, breakdown),
    }


def route_check(case: Case, breakdown: dict) -> dict:
    """``ran``: the attention kernels the profiler saw the case launch; ``route_ok``: whether a route's row ran its
    kernel (None: the default route, or no attention kernel named by the profiler, so nothing to check)."""
    ran = sorted(name for name in breakdown if name in ATTENTION_KERNELS)
    expected = ROUTE_KERNELS.get(case.kernel)
    if expected is None or "error" in breakdown or not breakdown:
        # the library's own choice, or a profiler that could not run or saw no device activity: nothing to check
        return {"ran": ran, "route_ok": None}
    return {"ran": ran, "route_ok": expected in ran}  # no attention kernel it knows: not the route's either


def error_row(case: Case, error) -> dict:
    """The row of a case that failed (``error``: the exception, or a sentence): its label and the error's first
    line."""
    if isinstance(error, BaseException):
        text = str(error).strip().splitlines()
        error = f"{type(error).__name__}: {text[0] if text else ''}"
    return {"label": case.label(), "op": case.op, "phase": case.phase, "kernel": case.kernel, "error": error}


def _device_usable() -> bool:
    """Whether the CUDA context still works after a case failed: an illegal address or a kernel fault is sticky, and
    every later call in this process would fail with it."""
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - the context is lost
        return False


def _cell(text: str) -> str:
    """``text`` safe in a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def device_breakdown(fn, calls: int = 10) -> dict:
    """Device time per call in ms of each kernel and copy ``fn()`` enqueues (torch's profiler, CUDA activity), or
    ``{"error": ...}`` where the profiler cannot run."""
    import torch

    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        out = {}
        for e in prof.key_averages():
            total = getattr(e, "self_device_time_total", None)
            if total is None:
                total = getattr(e, "self_cuda_time_total", 0)
            if total > 0:
                name = short_name(e.key)
                out[name] = out.get(name, 0.0) + total / 1e3 / calls
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
    except Exception as error:  # noqa: BLE001 - a profiler that cannot run is reported, the timings stand
        return {"error": f"{type(error).__name__}: {error}"}


def short_name(kernel: str) -> str:
    """A profiler event's name without return type, namespaces and template arguments ("TileKernel"); the staged
    decode kernel's second form (its last template argument true) is "StagedDecodeKernel, heads in registers"."""
    import re

    name = re.sub(r"^void |[A-Za-z_]+::|\(anonymous namespace\)::", "", kernel)
    if name.startswith("Memcpy"):
        return name
    signature = name.split("(", 1)[0].rstrip()  # "Kernel<T, Rows, true>": the template arguments end it
    base = signature.split("<", 1)[0]
    if base == "StagedDecodeKernel" and signature.endswith(", true>"):  # (a nested argument would end ">>")
        return base + ", heads in registers"
    return base


def breakdown_table(rows) -> str:
    lines = ["| case | host ms per call | device ms per call, by kernel or copy |", "| --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | | failed: {_cell(r['error'])} |")
            continue
        parts = r.get("device_breakdown") or {}
        text = parts["error"] if "error" in parts else "; ".join(f"{k}: {v:.4f}" for k, v in parts.items())
        lines.append(f"| {r['label']} | {r['host_ms']:.3f} | {text} |")
    return "\n".join(lines) + "\n"


def _ran(row) -> str:
    return ", ".join(row["ran"]) or "no attention kernel this benchmark knows"


def _verdict(value, target) -> str:
    if target is None:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({'met' if value >= target else 'missed'} >= {target})"


def markdown_table(rows) -> str:
    lines = ["| case | MB read | op ms | read GB/s | copy GB/s | op / copy | of copy bandwidth | sdpa ms | vs sdpa "
             "| sdpa backend | max abs diff vs sdpa |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {_cell(r['error'])} | | | | | | | | | |")
            continue
        diff = "" if r["max_abs_diff_vs_sdpa"] is None else f"{r['max_abs_diff_vs_sdpa']:.3g}"
        label = r["label"] if r.get("route_ok") is not False else f"{r['label']} (but ran {_ran(r)})"
        lines.append(f"| {label} | {r['bytes_read'] / 1e6:.1f} | {r['op_ms']:.3f} | {r['read_GBps']:.1f} | "
                     f"{r['copy_GBps']:.1f} | {_verdict(r['vs_copy'], r['copy_target'])} | "
                     f"{r['copy_bandwidth_fraction']:.2f} | {r['sdpa_ms']:.3f} | "
                     f"{_verdict(r['vs_sdpa'], r['sdpa_target'])} | {r['sdpa_backend']} | {diff} |")
    return "\n".join(lines) + "\n"


def write_results(rows, out, command: str, device: str, torch_version: str) -> None:
    """Writes results.json and results.md (device, command, definitions, table) into ``out``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    notes = __doc__.split("Figures, per case:", 1)[1].strip()
    (out / "results.json").write_text(json.dumps({"command": command, "device": device, "torch": torch_version,
                                                  "definitions": notes, "rows": rows}, indent=1))
    text = [f"# Attention CUDA benchmark ({device})", "", f"Device: {device}, torch {torch_version}", "",
            f"Command: `{command}`", "", notes, "", markdown_table(rows), "",
            "Where a call's time goes (host: validation, planning, enqueueing, on a drained stream; device: torch's "
            "profiler, per call):", "", breakdown_table(rows)]
    (out / "results.md").write_text("\n".join(text))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.gpu.attention", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--repeats", type=at_least(1), default=20)
    parser.add_argument("--out", type=out_folder, help="folder for results.md and results.json")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the tool runs, measures nothing")
    return parser


def main(argv=None) -> int:
    """Runs the attention CUDA benchmark; 0 when every case ran its route, 1 when a case failed or ran another kernel
    (the table keeps every row), 2 (one line on stderr) when the machine lacks what it needs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    missing = missing_requirements()
    if missing:
        print("attention CUDA benchmark: cannot run: " + "; ".join(missing), file=sys.stderr)
        return 2
    import torch

    command = recorded_command("kvcache_op.benchmarks.gpu.attention", argv)
    device = torch.cuda.get_device_name()
    print(f"Attention CUDA benchmark on {device} (torch {torch.__version__})", flush=True)
    rows, lost = [], None
    with torch.cuda.stream(torch.cuda.Stream()):  # one stream, not the legacy default one
        for case in cases(args.quick):
            if lost is not None:
                r = error_row(case, f"not run: the CUDA context was lost in {lost}")
            else:
                try:
                    r = measure(case, args.warmup, args.repeats)
                    route = "" if r["route_ok"] is not False else f"; NOT ITS ROUTE: ran {_ran(r)}"
                    print(f"{case.label()}: op {r['op_ms']:.3f} ms, op/copy {r['vs_copy']:.2f}x, "
                          f"vs sdpa ({r['sdpa_backend']}) {r['vs_sdpa']:.2f}x{route}", flush=True)
                    torch.cuda.empty_cache()  # the next case allocates its own buffers
                except Exception as error:  # noqa: BLE001 - one case's failure is its row; the others still run
                    r = error_row(case, error)
                    print(f"{case.label()}: failed: {r['error']}", flush=True)
                    if not _device_usable():  # a sticky error: every later case would fail with it
                        lost = case.label()
            rows.append(r)
            if args.out:  # after every case: a run stopped later keeps these rows
                write_results(rows, args.out, command, device, torch.__version__)
    if args.out:
        print(f"wrote {args.out}/results.md")
    print()
    print(markdown_table(rows), end="")
    print(breakdown_table(rows), end="")
    bad = [r["label"] for r in rows if "error" in r or r.get("route_ok") is False]
    if bad:
        print(f"{len(bad)} case(s) failed or ran another kernel than their route's: {'; '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
