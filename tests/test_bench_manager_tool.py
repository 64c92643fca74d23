"""The manager benchmark runs end to end on a small workload, side by side with a baseline manager loaded
from sources, and the seed baseline agrees on reuse; options it cannot run with are refused before any timing."""

import json
import pathlib
import shutil

import pytest

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
    for name in ("manager", "copy"):  # kvlen 16 at 2 prefills is in both sweeps: one case, one figure
        assert result["mixed"][name]["context"]["16"] == result["mixed"][name]["prefills"]["2"]
    # The same workload on the same code reuses the same prefixes.
    assert result["chat"]["manager"] == result["chat"]["copy"] and result["chat"]["manager"]["hit_tokens"] > 0
    assert "| chat prefix hit rate |" in (out / "results.md").read_text()
    assert "manager / seed" in capsys.readouterr().out


SMALL = ["--requests", "4", "--prompt-len", "64", "--shared", "16", "--pages", "40", "--batch", "2", "--kvlen", "16",
         "--steps", "2", "--repeats", "1", "--mixed-kvlens", "16", "--mixed-prefills", "0", "1", "--prefill-len", "8",
         "--chat-conversations", "2", "--chat-turns", "1", "--chat-concurrent", "1", "--chat-pages", "40"]


@pytest.mark.parametrize("change, message", [
    (["--baseline-name", "manager"], "this package's own row's name"),
    (["--baseline-name", "seed"], "this package's own row's name"),
    (["--shared", "100"], "exceeds --prompt-len"),
    (["--pages", "2"], "cannot hold one prompt"),
    (["--chat-pages", "2"], "cannot hold 1 conversations"),
    (["--baseline", "/nonexistent-folder"], "--baseline /nonexistent-folder"),
])
def test_options_it_cannot_run_with_are_refused_in_one_line_before_timing(tmp_path, capsys, change, message):
    argv = SMALL + change
    if change[0] == "--baseline-name":
        (tmp_path / "manager").mkdir()
        argv += ["--baseline", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        bench_manager.main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and "match+insert" not in captured.out


def test_seed_block_trie_reuses_a_shared_prefix():
    trie = BlockTrie(num_blocks=5, block_size=2)
    first = trie.allocate([1, 2, 3, 4, 5, 6, 7])
    assert trie.allocate([1, 2, 3, 4]) == first[:2]
