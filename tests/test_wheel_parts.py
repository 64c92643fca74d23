"""The offline transfer of a large wheel in parts: exact reassembly, and refusal of any damaged part."""

import os

import pytest

from repo_scripts import load

wheel_parts = load("tools/wheel_parts.py")


def test_split_then_join_gives_the_same_bytes(tmp_path):
    original = tmp_path / "pkg-1.0-py3-none-any.whl"
    original.write_bytes(os.urandom(2_500_000))
    parts = wheel_parts.split(original, tmp_path / "parts", size_mb=1)
    assert len(parts) == 3 and all(p.stat().st_size <= 2**20 for p in parts)
    joined = wheel_parts.join(tmp_path / "parts", tmp_path / "out")
    assert joined.name == original.name and joined.read_bytes() == original.read_bytes()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_part_is_refused_by_name(tmp_path, damage):
    original = tmp_path / "pkg.whl"
    original.write_bytes(os.urandom(300_000))
    parts = wheel_parts.split(original, tmp_path / "parts", size_mb=0.1)
    victim = parts[1]
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[10] ^= 1
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    else:
        victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        wheel_parts.join(tmp_path / "parts", tmp_path / "out")
    assert not (tmp_path / "out" / original.name).exists()
    assert wheel_parts.main(["join", str(tmp_path / "parts"), "--out", str(tmp_path / "out")]) == 1
