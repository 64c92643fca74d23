"""Compiles a test's shared library with the host C++ compiler, once per source version, into a cache folder."""

import hashlib
import os
import pathlib
import shutil
import subprocess


def compiler() -> str:
    """The host C++ compiler ($CXX, else c++ or g++); RuntimeError when there is none."""
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if found is None:
        raise RuntimeError("no C++ compiler (c++ / g++ / $CXX) to build a test library")
    return found


def build_library(name: str, sources: list, headers: list, flags: list, cache_dir: pathlib.Path) -> pathlib.Path:
    """``cache_dir/name-<digest>.so`` built from ``sources`` with ``flags``, unless a build of the same compiler,
    flags, sources and ``headers`` is there already. Written under a temporary name first, so that a
    concurrent or interrupted build never leaves a partial library behind."""
    cxx = compiler()
    digest = hashlib.sha256(" ".join([cxx] + flags).encode())
    for path in list(sources) + list(headers):
        digest.update(path.read_bytes())
    target = cache_dir / f"{name}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([cxx, *flags, *map(str, sources), "-o", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {name} failed:\n{done.stderr[-4000:]}")
        partial.replace(target)
    return target
