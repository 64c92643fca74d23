"""tools/attention_host_cost.py: it builds from this checkout and times the host side of a CUDA attention call, and
the plans it times have the tiles and words counted here by hand from the planner's rules (the GPU path's defaults:
four heads a decode tile, 64 query vectors a tensor-core tile, decode tiles split into parts of at least 256 keys
until about 1056 blocks)."""

import pytest

from repo_scripts import load

cost = load("tools/attention_host_cost.py")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return cost.build(tmp_path_factory.mktemp("host_cost"))


def index_words(batch, pages):
    """seqstarts, kvstarts, causal, cachestarts (pages of 16 slots)."""
    return 2 * (batch + 1) + batch + batch * pages


def test_a_decode_plan_splits_each_head_group_into_four_parts(lib):
    validate, pack, plan, words, tiles = cost.measure(lib, 64, 1, 1024, 8, 2, 0, False)
    # 64 sequences x 2 kv heads, one tile of four heads each: 128 tiles, split into min(1024 / 256, 1056 / 128 -> 9)
    # = 4 parts of 256 keys, and 128 merges.
    assert tiles == 128 * 4
    assert words == index_words(64, 1024 // 16) + (128 * 4 + 128) * 8
    assert validate > 0 and pack > 0 and plan > 0


def test_a_prefill_plan_has_one_tensor_core_tile_per_16_rows_of_a_head_group(lib):
    validate, pack, plan, words, tiles = cost.measure(lib, 8, 1024, 1024, 32, 8, 0, True)
    # 8 sequences x 8 kv heads x 1024 / 16 row blocks (64 query vectors: 16 rows of 4 heads); 4096 tiles, none split.
    assert tiles == 8 * 8 * 64
    assert words == index_words(8, 1024 // 16) + tiles * 8
    assert validate > 0 and plan > 0
