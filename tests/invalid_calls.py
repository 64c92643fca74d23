"""The KeyValueCache validity rows live in the package (kvcache_op.validation.error_cases), where the conformance
vectors and ``kvcache-op fuzz`` use them too."""

from kvcache_op.validation.error_cases import (INVALID, MORE_INVALID, base, make_invalid,  # noqa: F401
                                         _apply, _item, _reshape, _retype, _set)
