"""The hypothesis strategies live in the package (kvcache_op.validation.strategies), shared with ``kvcache-op fuzz``."""

from kvcache_op.validation.strategies import COMBINATIONS, DTYPES, calls, calls_for, sequences, shift_calls  # noqa: F401
