"""The hypothesis strategies live in the package (kvcache_op.spec.strategies), shared with ``kvcache-op fuzz``."""

from kvcache_op.spec.strategies import COMBINATIONS, DTYPES, calls, calls_for, sequences, shift_calls  # noqa: F401
