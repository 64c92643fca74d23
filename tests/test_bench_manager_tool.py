"""The manager benchmark runs end to end on a small workload and the seed baseline agrees on reuse."""

import json

from kvcache_op.tools import bench_manager
from kvcache_op.tools.block_trie_seed import BlockTrie


def test_bench_manager_small_run(tmp_path, capsys):
    assert bench_manager.main(["--requests", "20", "--prompt-len", "64", "--shared", "32", "--pages", "40",
                               "--batch", "4", "--kvlen", "16", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["manager_tokens_per_s"] > 0 and result["seed_tokens_per_s"] > 0
    assert 0 < result["hit_rate"] < 1 and result["evictions"] > 0
    assert "manager / seed" in capsys.readouterr().out


def test_seed_block_trie_reuses_a_shared_prefix():
    trie = BlockTrie(num_blocks=5, block_size=2)
    first = trie.allocate([1, 2, 3, 4, 5, 6, 7])
    assert trie.allocate([1, 2, 3, 4]) == first[:2]
