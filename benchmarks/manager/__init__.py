"""The cache manager's cost per step and its prefix hit rate, against a baseline revision and the seed
block-trie design (``bench``, ``workloads``, ``block_trie_seed``)."""
