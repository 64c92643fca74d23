"""The attention strategies live in the package (kvcache_op.spec.strategies), shared with ``kvcache-op fuzz``."""

from kvcache_op.spec.strategies import ATTENTION_DTYPES as DTYPES, attention_calls, copies  # noqa: F401
