"""The attention strategies live in the package (kvcache_op.validation.strategies), shared with ``kvcache-op fuzz``."""

from kvcache_op.validation.strategies import ATTENTION_DTYPES as DTYPES, attention_calls, copies  # noqa: F401
