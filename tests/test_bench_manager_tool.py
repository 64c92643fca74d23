"""The manager benchmark runs end to end on a small workload, side by side with a baseline manager loaded
from sources, and the seed baseline agrees on reuse."""

import json
import pathlib
import shutil

from kvcache_op import manager
from kvcache_op.benchmarks.manager import bench as bench_manager
from kvcache_op.benchmarks.manager.block_trie_seed import BlockTrie


def test_bench_manager_small_run(tmp_path, capsys):
    baseline = tmp_path / "baseline"
    shutil.copytree(pathlib.Path(manager.__file__).parent, baseline / "manager")
    out = tmp_path / "out"
    assert bench_manager.main(["--requests", "20", "--prompt-len", "64", "--shared", "32", "--pages", "40",
                               "--batch", "4", "--kvlen", "16", "--steps", "20", "--repeats", "1",
                               "--mixed-kvlens", "16", "48", "--mixed-prefills", "0", "2", "--prefill-len", "20",
                               "--chat-conversations", "6", "--chat-turns", "2", "--chat-concurrent", "2",
                               "--chat-pages", "40", "--baseline", str(baseline), "--baseline-name", "copy",
                               "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["names"] == ["manager", "copy"]
    assert result["manager_tokens_per_s"] > 0 and result["seed_tokens_per_s"] > 0
    assert 0 < result["hit_rate"] < 1 and result["evictions"] > 0
    for kind in ("sync", "staggered"):
        assert all(result["decode"][kind][name]["median_s"] > 0 for name in ("manager", "copy"))
    assert set(result["mixed"]["copy"]["context"]) == {"16", "48"}
    # The same workload on the same code reuses the same prefixes.
    assert result["chat"]["manager"] == result["chat"]["copy"] and result["chat"]["manager"]["hit_tokens"] > 0
    assert "| chat prefix hit rate |" in (out / "results.md").read_text()
    assert "manager / seed" in capsys.readouterr().out


def test_seed_block_trie_reuses_a_shared_prefix():
    trie = BlockTrie(num_blocks=5, block_size=2)
    first = trie.allocate([1, 2, 3, 4, 5, 6, 7])
    assert trie.allocate([1, 2, 3, 4]) == first[:2]
