"""The MultiHeadAttention validity rows live in the package (kvcache_op.validation.mha_error_cases), where the
conformance vectors and ``kvcache-op fuzz`` use them too."""

from kvcache_op.validation.mha_error_cases import INVALID, base, make_invalid  # noqa: F401
