"""A backend module whose import hangs when ``KVCACHE_TEST_SLOW_IMPORT`` is set (what a worker's start timeout
must cover); otherwise it offers the reference."""

import os
import time

from kvcache_op.reference import key_value_cache  # noqa: F401 - the backend, once imported

if os.environ.get("KVCACHE_TEST_SLOW_IMPORT"):
    time.sleep(600)
