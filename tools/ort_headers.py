"""Finds ONNX Runtime's C/C++ headers (API 29) for building the custom-op library.

Order: ``$KVCACHE_OP_ORT_INCLUDE_DIR`` (a folder holding ``onnxruntime_c_api.h``); else a cached copy in
``$XDG_CACHE_HOME/kvcache-op`` (default ``~/.cache/kvcache-op``); else the official headers are
extracted from the npm registry package that ships them (``npm pack``), and cached. Run as a script
it prints the folder (CMake calls it so); it exits non-zero with a clear message when it cannot.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

ORT_API_VERSION = 29
NPM_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
HEADERS_IN_PACKAGE = ("package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/"
                      "onnxruntime.framework/Headers/")
ENV_VAR = "KVCACHE_OP_ORT_INCLUDE_DIR"
NEEDED = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h", "onnxruntime_float16.h")


def _has_headers(folder: pathlib.Path) -> bool:
    return all((folder / name).is_file() for name in NEEDED)


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "kvcache-op" / f"onnxruntime-headers-api{ORT_API_VERSION}"


def _from_npm(target: pathlib.Path, log) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH, so the ONNX Runtime headers cannot be fetched")
    with tempfile.TemporaryDirectory() as tmp:
        log(f"fetching ONNX Runtime headers: npm pack {NPM_PACKAGE} (about 150 MB, once)")
        done = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"npm pack {NPM_PACKAGE} failed: {done.stderr.strip()[-500:]}")
        tarball = next(pathlib.Path(tmp).glob("*.tgz"))
        staging = pathlib.Path(tmp) / "headers"
        staging.mkdir()
        with tarfile.open(tarball) as archive:
            for member in archive.getmembers():
                if member.name.startswith(HEADERS_IN_PACKAGE) and member.isfile() and member.name.endswith(".h"):
                    data = archive.extractfile(member).read()
                    (staging / pathlib.Path(member.name).name).write_bytes(data)
        if not _has_headers(staging):
            raise RuntimeError(f"{NPM_PACKAGE} did not contain the expected headers under {HEADERS_IN_PACKAGE}")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(staging), str(target))


def find_headers(log=lambda m: print(m, file=sys.stderr)) -> pathlib.Path:
    """The headers folder; raises ``RuntimeError`` explaining what to set when none can be found."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        folder = pathlib.Path(explicit)
        if not _has_headers(folder):
            raise RuntimeError(f"{ENV_VAR}={explicit} does not hold {', '.join(NEEDED)}")
        return folder.resolve()
    cached = cache_dir()
    if _has_headers(cached):
        return cached
    try:
        _from_npm(cached, log)
    except (RuntimeError, OSError) as error:
        raise RuntimeError(f"could not obtain ONNX Runtime API-{ORT_API_VERSION} headers ({error}); set {ENV_VAR} "
                           f"to a folder with {', '.join(NEEDED)}") from error
    return cached


if __name__ == "__main__":
    try:
        print(find_headers())
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
