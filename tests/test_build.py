"""The installed library: found, loadable by ONNX Runtime, and built with CUDA wherever nvcc exists; and
where its build takes ONNX Runtime's headers from (cmake/ort_headers.py, checked here without network)."""

import hashlib
import io
import os
import pathlib
import shutil
import tarfile

import pytest

from kvcache_op.ort_ops import LIBRARY_ENV, library_path
from repo_scripts import load

ort_headers = load("cmake/ort_headers.py")


def test_library_is_installed_and_registers_in_onnxruntime():
    from kvcache_op.ort_ops import session_options

    assert pathlib.Path(library_path()).is_file()
    session_options()  # register_custom_ops_library raises if RegisterCustomOps fails


@pytest.mark.skipif(shutil.which("nvcc") is None or os.environ.get("KVCACHE_OP_CUDA") == "0",
                    reason="no nvcc here (or CUDA disabled): the library is CPU-only by design")
def test_library_contains_the_cuda_variant_when_nvcc_exists():
    assert b"CUDAExecutionProvider" in pathlib.Path(library_path()).read_bytes()


def test_library_override_must_exist(monkeypatch):
    monkeypatch.setenv(LIBRARY_ENV, "/nonexistent/libkvcache_op_ort.so")
    with pytest.raises(FileNotFoundError, match=LIBRARY_ENV):
        library_path()


# --- ONNX Runtime headers (cmake/ort_headers.py) ---


def _fake_archive(folder, contents=b"/* not onnxruntime */"):
    """A small npm-style archive with every pinned header at the pinned package's path."""
    path = folder / "fake.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name in ort_headers.PINNED_HEADERS:
            info = tarfile.TarInfo(ort_headers.HEADERS_IN_ARCHIVE + name)
            info.size = len(contents)
            tar.addfile(info, io.BytesIO(contents))
    return path


def _pin_to(monkeypatch, archive, contents=b"/* not onnxruntime */"):
    """Makes the fake archive the pinned one."""
    monkeypatch.setattr(ort_headers, "ARCHIVE_SHA256", ort_headers.sha256_of(archive))
    digest = hashlib.sha256(contents).hexdigest()
    monkeypatch.setattr(ort_headers, "PINNED_HEADERS", {name: digest for name in ort_headers.PINNED_HEADERS})


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """An empty cache and no include-dir override; fetch_archive serves the fake archive and counts calls."""
    monkeypatch.delenv(ort_headers.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    archive = _fake_archive(tmp_path)
    fetches = []

    def fetch(folder, log):
        fetches.append(folder)
        return pathlib.Path(shutil.copy(archive, folder))

    monkeypatch.setattr(ort_headers, "fetch_archive", fetch)
    return archive, fetches


def test_an_archive_that_is_not_the_pinned_one_is_refused(tmp_path):
    target = tmp_path / "headers"
    with pytest.raises(RuntimeError, match=f"fake.tgz: SHA-256 [0-9a-f]{{64}} is not the pinned "
                                           f"{ort_headers.ARCHIVE_SHA256} of {ort_headers.NPM_PACKAGE}"):
        ort_headers.extract_verified(_fake_archive(tmp_path), target)
    assert not target.exists()


def test_a_header_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    archive = _fake_archive(tmp_path)
    _pin_to(monkeypatch, archive, contents=b"/* what the pins expect */")  # the archive passes, its headers not
    target = tmp_path / "headers"
    target.mkdir()
    (target / "kept").write_text("a previous copy")
    with pytest.raises(RuntimeError, match=r"onnxruntime_c_api.h in .*: SHA-256 [0-9a-f]{64} is not the pinned"):
        ort_headers.extract_verified(archive, target)
    assert [p.name for p in target.iterdir()] == ["kept"]  # left as it was


def test_verified_headers_are_cached_and_reused(no_network, monkeypatch):
    archive, fetches = no_network
    _pin_to(monkeypatch, archive)
    folder = ort_headers.find_headers(log=lambda m: None)
    assert folder == ort_headers.cache_dir() and sorted(p.name for p in folder.iterdir()) == sorted(
        ort_headers.PINNED_HEADERS)
    assert ort_headers.find_headers(log=lambda m: None) == folder and len(fetches) == 1


def test_a_cached_header_that_changed_is_fetched_again(no_network, monkeypatch):
    archive, fetches = no_network
    _pin_to(monkeypatch, archive)
    folder = ort_headers.find_headers(log=lambda m: None)
    (folder / "onnxruntime_float16.h").write_text("changed")
    said = []
    assert ort_headers.find_headers(log=said.append) == folder and len(fetches) == 2
    assert "onnxruntime_float16.h" in said[0] and "do not match their pins" in said[0]


def test_a_fetch_of_other_bytes_fails_the_build_with_the_reason(no_network):
    with pytest.raises(RuntimeError, match=f"is not the pinned {ort_headers.ARCHIVE_SHA256}.*"
                                           f"Offline, set {ort_headers.ENV_VAR}"):
        ort_headers.find_headers(log=lambda m: None)
    assert not ort_headers.cache_dir().exists()


def test_the_include_dir_override_comes_first(no_network, monkeypatch, tmp_path):
    archive, fetches = no_network
    _pin_to(monkeypatch, archive)
    ort_headers.find_headers(log=lambda m: None)  # a valid cache exists too
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ort_headers.REQUIRED:
        (mine / name).write_text("")
    monkeypatch.setenv(ort_headers.ENV_VAR, str(mine))
    assert ort_headers.find_headers() == mine.resolve() and len(fetches) == 1


def test_an_include_dir_override_without_the_headers_is_an_error(no_network, monkeypatch, tmp_path):
    monkeypatch.setenv(ort_headers.ENV_VAR, str(tmp_path))
    with pytest.raises(RuntimeError, match=f"{ort_headers.ENV_VAR}=.* does not hold onnxruntime_c_api.h"):
        ort_headers.find_headers()
    assert no_network[1] == []
