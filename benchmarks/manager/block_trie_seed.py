"""The block-trie prefix cache of the lmdeploy discussion (the seed design), re-implemented as a
baseline for benchmarks/manager/bench.py: a trie of blocks keyed by the hash of each block's tokens,
ref counts, and eviction of unreferenced leaves by scanning the leaves into a heap on every eviction."""

import heapq
import itertools
import time


class _Node:
    __slots__ = ("children", "key", "block", "tokens", "last_access", "ref_count", "parent")

    def __init__(self):
        self.children = {}
        self.key = None
        self.block = None
        self.tokens = ()
        self.last_access = -1.0
        self.ref_count = 0
        self.parent = None


class BlockTrie:
    """allocate(tokens) -> blocks (matched or inserted); free(tokens, blocks) releases them."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.root = _Node()
        self.leaves = {self.root}
        self._tie = itertools.count()

    def allocate(self, tokens):
        blocks = []
        node = self.root
        bs = self.block_size
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = hash(chunk)
            child = node.children.get(key)
            if child is not None:
                if child.tokens != chunk:
                    break  # collision: no reuse
                child.ref_count += 1
                child.last_access = time.time()
                blocks.append(child.block)
                node = child
                continue
            if not self.free_blocks and not self._evict(1):
                break
            child = _Node()
            child.key, child.block, child.tokens = key, self.free_blocks.pop(), chunk
            child.ref_count, child.last_access, child.parent = 1, time.time(), node
            self.leaves.add(child)
            self.leaves.discard(node)
            node.children[key] = child
            blocks.append(child.block)
            node = child
        return blocks

    def free(self, tokens, blocks):
        node = self.root
        bs = self.block_size
        for i in range(len(blocks)):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(hash(chunk))
            if child is None or child.tokens != chunk:
                break
            child.ref_count -= 1
            child.last_access = time.time()
            node = child

    def _evict(self, count):
        heap = [(leaf.last_access, next(self._tie), leaf) for leaf in self.leaves
                if leaf.ref_count == 0 and leaf is not self.root]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < count:
            _, _, leaf = heapq.heappop(heap)
            del leaf.parent.children[leaf.key]
            self.leaves.discard(leaf)
            self.free_blocks.append(leaf.block)
            evicted += 1
            parent = leaf.parent
            if not parent.children and parent is not self.root:
                self.leaves.add(parent)
                if parent.ref_count == 0:
                    heapq.heappush(heap, (parent.last_access, next(self._tie), parent))
        return evicted
