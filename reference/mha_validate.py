"""Every validity condition of spec/MultiHeadAttention.md section "Validity", in its order.

``validate_attention`` returns an :class:`AttentionPlan` (each sequence's rows, whether the causal rule
applies to it, the score scale) or raises :class:`MultiHeadAttentionError` naming the input, the
sequence index and the values involved. The index checks are KeyValueCache's (same messages).
"""

import dataclasses
import math

import numpy as np

from .dtypes import T1_TYPES, dtype_name
from .validate import KeyValueCacheError, check_max, index_scalar, index_vector, starts_lengths


class MultiHeadAttentionError(KeyValueCacheError):
    """Invalid input to MultiHeadAttention (a ``ValueError``, like every error of the project's ops)."""


def fail(message: str):
    raise MultiHeadAttentionError(message)


@dataclasses.dataclass(frozen=True)
class AttentionAttributes:
    """The op's attributes; ``num_heads`` and ``head_dim`` have no default (ppl requires them)."""

    num_heads: int
    head_dim: int
    is_causal: int = 1
    is_alibi: int = 0
    num_kv_heads: int = 0
    sliding_window: int = 0
    softmax_scale: float = 0.0
    softcap: float = 0.0  # extension: Gemma 2's score cap, 0 off

    @property
    def kv_heads(self) -> int:
        """Heads of ``key``/``value``: ``num_kv_heads``, or ``num_heads`` when it is 0."""
        return self.num_kv_heads or self.num_heads


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """What one valid call computes: per sequence b, its rows and whether the causal rule applies."""

    seq_begin: list  # [B] first row of sequence b in query / output
    seq_len: list  # [B]
    kv_begin: list  # [B] first row of sequence b in key / value (and column in attn_mask)
    kv_len: list  # [B]
    causal: list  # [B] bool: is_causal, seqlen > 1 and b >= decoding_batches
    scale: np.float32  # the score scale: softmax_scale, or float32(1 / sqrt(head_dim))


def check_attention_attributes(a: AttentionAttributes) -> None:
    """Attribute values the spec allows (independent of the inputs)."""
    if a.num_heads < 1:
        fail(f"num_heads must be >= 1, got {a.num_heads}")
    if a.head_dim < 1:
        fail(f"head_dim must be >= 1, got {a.head_dim}")
    if a.is_causal not in (0, 1):
        fail(f"is_causal must be 0 or 1, got {a.is_causal}")
    if a.is_alibi not in (0, 1):
        fail(f"is_alibi must be 0 or 1, got {a.is_alibi}")
    if a.num_kv_heads < 0 or (a.num_kv_heads and a.num_heads % a.num_kv_heads):
        fail(f"num_kv_heads must be 0 (= num_heads) or divide num_heads = {a.num_heads}, got {a.num_kv_heads}")
    if a.sliding_window < 0:
        fail(f"sliding_window must be >= 0 (0: no window), got {a.sliding_window}")
    with np.errstate(over="ignore"):  # float32 attributes in ONNX: judged after that rounding (to inf too)
        scale, cap = np.float32(a.softmax_scale), np.float32(a.softcap)
    if not (np.isfinite(scale) and scale >= 0):
        fail(f"softmax_scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got {float(scale):g}")
    if not (np.isfinite(cap) and cap >= 0):
        fail(f"softcap must be finite and >= 0 (0: off), got {float(cap):g}")


def score_scale(a: AttentionAttributes) -> np.float32:
    """``softmax_scale`` rounded to float32, or ``float32(1 / sqrt(head_dim))`` (computed in float64) when that
    is 0."""
    scale = np.float32(a.softmax_scale)  # a value that rounds to 0 in float32 is 0: the default
    return scale if scale else np.float32(1.0 / math.sqrt(a.head_dim))


def _check_data(query, key, value, attn_mask, a: AttentionAttributes) -> None:
    """Dtypes and shapes of query, key, value and attn_mask."""
    if query.dtype not in T1_TYPES:
        fail(f"query dtype must be float32, float16 or bfloat16, got {dtype_name(query.dtype)}")
    if query.ndim != 3 or query.shape[1:] != (a.num_heads, a.head_dim):
        fail(f"query must have shape (tokens, num_heads={a.num_heads}, head_dim={a.head_dim}), got {query.shape}")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            fail(f"{name} dtype must be query's ({dtype_name(query.dtype)}), got {dtype_name(x.dtype)}")
        if x.ndim != 3 or x.shape[1:] != (a.kv_heads, a.head_dim):
            fail(f"{name} must have shape (kv_tokens, num_kv_heads={a.kv_heads}, head_dim={a.head_dim}), "
                 f"got {x.shape}")
    if value.shape != key.shape:
        fail(f"value shape {value.shape} must equal key shape {key.shape}")
    if attn_mask is None:
        return
    tokens, kv_tokens = query.shape[0], key.shape[0]
    if attn_mask.dtype != query.dtype:
        fail(f"attn_mask dtype must be query's ({dtype_name(query.dtype)}), got {dtype_name(attn_mask.dtype)}")
    rank3 = attn_mask.ndim == 3 and attn_mask.shape[0] == a.num_heads
    if not (rank3 or attn_mask.ndim == 2) or attn_mask.shape[-2] != tokens or attn_mask.shape[-1] < kv_tokens:
        fail(f"attn_mask must have shape (num_heads={a.num_heads}, {tokens}, >= {kv_tokens}) or ({tokens}, "
             f">= {kv_tokens}) (query tokens, key tokens), got {attn_mask.shape}")


def validate_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask,
                       a: AttentionAttributes) -> AttentionPlan:
    """All checks of the spec, in its order; returns the plan of a valid call."""
    try:
        return _validate(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                         attn_mask, a)
    except MultiHeadAttentionError:
        raise
    except KeyValueCacheError as error:  # the shared index checks: same message, this op's error class
        raise MultiHeadAttentionError(str(error)) from None


def _validate(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask, a):
    check_attention_attributes(a)
    _check_data(query, key, value, attn_mask, a)
    seq = index_vector("seqstarts", seqstarts)
    if not seq:
        fail("seqstarts must have B + 1 >= 1 elements, got 0")
    batch = len(seq) - 1
    kv = index_vector("kvstarts", kvstarts, batch + 1)
    decoding = index_scalar("decoding_batches", decoding_batches)
    max_seqlen = index_scalar("max_seqlen", max_seqlen)
    max_kvlen = index_scalar("max_kvlen", max_kvlen)
    seq_len = starts_lengths("seqstarts", seq, "query.shape[0]", query.shape[0])
    kv_len = starts_lengths("kvstarts", kv, "key.shape[0]", key.shape[0])
    check_max("max_seqlen", "seqlen", max_seqlen, seq_len)
    check_max("max_kvlen", "kvlen", max_kvlen, kv_len)
    if not 0 <= decoding <= batch:
        fail(f"decoding_batches = {decoding} must be in [0, B={batch}]")
    causal = [bool(a.is_causal) and seq_len[b] > 1 and b >= decoding for b in range(batch)]
    for b in range(batch):
        if causal[b] and seq_len[b] > kv_len[b]:
            fail(f"sequence {b}: seqlen = {seq_len[b]} exceeds kvlen = {kv_len[b]}, but the causal mask aligns its "
                 f"queries with its last seqlen keys (is_causal=1, b >= decoding_batches = {decoding})")
    return AttentionPlan(seq[:-1], seq_len, kv[:-1], kv_len, causal, score_scale(a))


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """A validated call: attributes, the data inputs as arrays, and the plan."""

    a: AttentionAttributes
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: np.ndarray  # or None
    plan: AttentionPlan


def prepare_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask,
                      *, num_heads, head_dim, is_causal, is_alibi, num_kv_heads, sliding_window,
                      softmax_scale, softcap=0.0) -> AttentionCall:
    """The attributes as ints (``softmax_scale`` and ``softcap`` floats), the data as arrays, every check of the
    spec."""
    a = AttentionAttributes(int(num_heads), int(head_dim), int(is_causal), int(is_alibi), int(num_kv_heads),
                            int(sliding_window), float(softmax_scale), float(softcap))
    query, key, value = np.asarray(query), np.asarray(key), np.asarray(value)
    attn_mask = None if attn_mask is None else np.asarray(attn_mask)
    plan = validate_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                              attn_mask, a)
    return AttentionCall(a, query, key, value, attn_mask, plan)
