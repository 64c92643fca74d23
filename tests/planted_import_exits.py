"""A backend module that ends the process while it is imported when ``KVCACHE_TEST_IMPORT_EXIT`` is ``sys`` or
``os`` (a script without a main guard); otherwise it offers the reference."""

import os
import sys

from kvcache_op.reference import key_value_cache  # noqa: F401 - the backend, once imported

if os.environ.get("KVCACHE_TEST_IMPORT_EXIT") == "sys":
    sys.exit(0)
if os.environ.get("KVCACHE_TEST_IMPORT_EXIT") == "os":
    os._exit(0)
