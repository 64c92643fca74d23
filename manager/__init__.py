"""Host-side KV-cache manager feeding the KeyValueCache op: paged allocation, prefix caching with
LRU eviction, sliding window, and the attention mask that matches the gathered keys."""

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
