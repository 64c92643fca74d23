"""Host-side KV-cache manager feeding the KeyValueCache op: paged allocation, prefix caching with
LRU eviction, sliding window, StreamingLLM, and the attention mask that matches the gathered keys.

:class:`KVCacheManager` (``kv_manager``: configuration and step transactions) is put together from one file per
responsibility: ``admission``, ``batch_lookup``, ``step_planner``, ``step_applier``, ``prefix_publisher``,
``inspection``; its state lives in ``page_pool``, ``prefix_index``, ``request_rows`` and ``step_records``.
Pure numpy: it imports nothing else of the package."""

from .errors import OutOfPages, UnknownRequest
from .kv_manager import KVCacheManager
from .masks import block_diagonal_causal_mask
from .offset_manager import OffsetCacheManager, OutOfSlots
from .page_pool import PagePool
from .prefix_index import PrefixIndex, keyed_page_hash
from .step_plan import StepPlan
from .streaming import StreamingPolicy

__all__ = ["KVCacheManager", "OffsetCacheManager", "OutOfPages", "OutOfSlots", "PagePool", "PrefixIndex", "StepPlan", "StreamingPolicy", "UnknownRequest",
           "block_diagonal_causal_mask", "keyed_page_hash"]
