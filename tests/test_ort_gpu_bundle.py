"""tools/ort_gpu_bundle.py: the fat binaries of other architectures zeroed in place (every offset kept, the kept
architecture's bytes untouched), a bundle that round-trips through its manifest's hash, and refusals by name."""

import struct
import zipfile

import pytest

from repo_scripts import load

bundle = load("tools/ort_gpu_bundle.py")


def entry(arch: int, payload: bytes, kind: int = 2) -> bytes:
    """One fat-binary entry: a 64-byte header (kind, version, header size, payload size, ..., arch at byte 28)."""
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def library() -> bytes:
    """Host code around three fat binaries (one with a stray magic before it, one without sm_90: machine code for
    sm_80 and its PTX), and a stray magic in the last bytes."""
    first = fatbin(entry(80, b"A" * 40), entry(90, b"B" * 24), entry(120, b"C" * 8))
    second = fatbin(entry(90, b"D" * 16, kind=1), entry(75, b"E" * 32))
    third = fatbin(entry(80, b"F" * 12), entry(80, b"G" * 20, kind=1))
    return (b"host" * 10 + struct.pack("<I", 0xBA55ED50) + b"x" * 7 + first + b"more host" + second + third
            + b"tail" + struct.pack("<I", 0xBA55ED50) + b"\x01\x00")


def test_other_architectures_are_zeroed_in_place():
    original = library()
    data = bytearray(original)
    found = bundle.prune_fatbins(data, 90)
    assert found == {80: 72, 90: 40, 120: 8, 75: 32}
    assert len(data) == len(original)
    for kept in (b"B" * 24, b"D" * 16, b"F" * 12, b"G" * 20):  # a fat binary without sm_90 stays whole
        assert kept in data
    for gone in (b"A" * 40, b"C" * 8, b"E" * 32):
        assert gone not in data
    changed = [i for i in range(len(data)) if data[i] != original[i]]
    assert len(changed) == 40 + 8 + 32 and all(data[i] == 0 for i in changed)


def test_a_library_without_the_architecture_or_any_fat_binary_is_refused():
    with pytest.raises(ValueError, match="no kernels for sm_100"):
        bundle.prune_fatbins(bytearray(library()), 100)
    with pytest.raises(ValueError, match="no CUDA fat binary"):
        bundle.prune_fatbins(bytearray(b"plain host code"), 90)


def test_a_bundle_round_trips_and_an_altered_one_is_refused(tmp_path):
    wheel = tmp_path / "onnxruntime_gpu-9.9-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(bundle.CUDA_PROVIDER, library())
        zf.writestr("onnxruntime/__init__.py", "x = 1\n")
        zf.writestr("onnxruntime/capi/libonnxruntime.so.9.9", b"C API")  # left out
        zf.writestr("onnxruntime/transformers/fusion_attention.py", "y = 2\n")  # left out: a tool subpackage
        zf.writestr("onnxruntime/capi/_ld_preload.py", "z = 3\n")  # kept: the package's own module
    made = bundle.make(wheel, 90, tmp_path / "out")
    unpacked = bundle.unpack(tmp_path / "out", tmp_path / "site")
    provider = (unpacked / bundle.CUDA_PROVIDER).read_bytes()
    assert len(provider) == len(library()) and b"B" * 24 in provider and b"A" * 40 not in provider
    assert (unpacked / "onnxruntime/__init__.py").read_text() == "x = 1\n"
    assert not (unpacked / "onnxruntime/capi/libonnxruntime.so.9.9").exists()
    assert not (unpacked / "onnxruntime/transformers").exists()
    assert (unpacked / "onnxruntime/capi/_ld_preload.py").read_text() == "z = 3\n"
    made.write_bytes(made.read_bytes()[:-1] + b"!")
    with pytest.raises(ValueError, match="SHA-256 differs"):
        bundle.unpack(tmp_path / "out", tmp_path / "again")
    assert bundle.main(["unpack", str(tmp_path / "out"), "--out", str(tmp_path / "again")]) == 1
