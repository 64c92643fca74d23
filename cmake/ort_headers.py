"""Finds ONNX Runtime's C/C++ headers for building the custom-op library.

Order:

1. ``$KVCACHE_OP_ORT_INCLUDE_DIR``: a folder holding ``onnxruntime_c_api.h`` and the C++ headers, from any
   onnxruntime release the library supports (>= 1.22). Used as given: whoever sets it vouches for it.
2. The cached copy in ``$XDG_CACHE_HOME/kvcache-op`` (default ``~/.cache/kvcache-op``), used only while every
   header still has its pinned SHA-256.
3. The pinned npm package (``npm pack``): its archive must have the pinned SHA-256, and so must each header
   taken from it; then the headers are cached.

Run as a script it prints the folder (CMake calls it so); it exits non-zero with a clear message when it
cannot.
"""

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

ENV_VAR = "KVCACHE_OP_ORT_INCLUDE_DIR"

# No official onnxruntime package on PyPI or npm carries the C headers (the wheels and
# onnxruntime-node/-web/-common hold none), and Debian's (from release 13 on) are onnxruntime 1.21's, older
# than the library needs. This npm package (a Unity plugin, about 150 MB) carries the API-29 headers of an
# ONNX Runtime release inside its iOS framework; the pins below make any other bytes an error.
NPM_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
ARCHIVE_SHA256 = "e59788788818fdde1b2e522e766a21ba0f7d8391de55737abf81e32cc801785d"
HEADERS_IN_ARCHIVE = ("package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/"
                      "onnxruntime.framework/Headers/")
HEADERS_API_VERSION = 29  # ORT_API_VERSION of the pinned headers (the library asks the runtime for less)

# Every header the build reads, directly or through another, with its SHA-256 in the pinned archive.
PINNED_HEADERS = {
    "onnxruntime_c_api.h": "acc0cf4b3f28d39339c76770d76164bb7a0637dc89f5fde764b4017b632f6743",
    "onnxruntime_cxx_api.h": "9c63ed5bf0427ddf1c10a99aca0beeec77318ce77d2ea6f7ae76d7d933660f67",
    "onnxruntime_cxx_inline.h": "c508dbb7d8203003a2584b8712118cb88e5b4ef1e1c7876a9974156fb7489301",
    "onnxruntime_float16.h": "88b242845d25981633a0bbd1c148e273cf8bfb016ea3f57c4af41a06530f72b0",
    "onnxruntime_error_code.h": "5ce3b054e798eced8d14f5b86e98692fd33470463f96194ce0700a2d53dd8721",
    "onnxruntime_ep_c_api.h": "e6c986c9e98583f8113b2c6bc3864814883b806d501cf24da4d239c45753e235",
}
# What a folder given in $KVCACHE_OP_ORT_INCLUDE_DIR must hold (older releases have no error_code/ep headers).
REQUIRED = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h", "onnxruntime_float16.h")


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_dir() -> pathlib.Path:
    """Where the verified headers are kept between builds."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "kvcache-op" / f"onnxruntime-headers-api{HEADERS_API_VERSION}"


def _mismatches(folder: pathlib.Path) -> list:
    """The pinned headers that are missing from ``folder`` or differ from their pins."""
    return [name for name, want in PINNED_HEADERS.items()
            if not (folder / name).is_file() or sha256_of(folder / name) != want]


def extract_verified(archive: pathlib.Path, target: pathlib.Path) -> None:
    """Checks ``archive`` and each pinned header in it against their SHA-256 pins, then puts the headers in
    ``target`` (replacing it). Raises ``RuntimeError`` naming the file, the pin and what was found; on any
    error ``target`` is left as it was."""
    found = sha256_of(archive)
    if found != ARCHIVE_SHA256:
        raise RuntimeError(f"{archive.name}: SHA-256 {found} is not the pinned {ARCHIVE_SHA256} of {NPM_PACKAGE}; "
                           "refusing its headers")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # same file system: the rename is atomic
        staging = pathlib.Path(tmp) / "headers"
        staging.mkdir()
        with tarfile.open(archive) as tar:
            for name, want in PINNED_HEADERS.items():
                try:  # members are read by exact name, never extracted by their own paths
                    data = tar.extractfile(HEADERS_IN_ARCHIVE + name).read()
                except (KeyError, AttributeError):
                    raise RuntimeError(f"{NPM_PACKAGE} has no {HEADERS_IN_ARCHIVE + name}") from None
                got = hashlib.sha256(data).hexdigest()
                if got != want:
                    raise RuntimeError(f"{name} in {NPM_PACKAGE}: SHA-256 {got} is not the pinned {want}; "
                                       "refusing the headers")
                (staging / name).write_bytes(data)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)


def fetch_archive(folder: pathlib.Path, log) -> pathlib.Path:
    """Downloads the pinned npm package into ``folder`` with ``npm pack``; returns the archive's path."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH, so the ONNX Runtime headers cannot be fetched")
    log(f"fetching ONNX Runtime headers: npm pack {NPM_PACKAGE} (about 150 MB, once)")
    done = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"npm pack {NPM_PACKAGE} failed: {done.stderr.strip()[-500:]}")
    archives = sorted(folder.glob("*.tgz"))
    if len(archives) != 1:
        raise RuntimeError(f"npm pack {NPM_PACKAGE} left {len(archives)} archives, expected one")
    return archives[0]


def find_headers(log=lambda m: print(m, file=sys.stderr)) -> pathlib.Path:
    """The headers folder (see the module docstring for the order). Raises ``RuntimeError`` saying what
    went wrong and how to supply the headers when none can be had."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        folder = pathlib.Path(explicit)
        missing = [name for name in REQUIRED if not (folder / name).is_file()]
        if missing:
            raise RuntimeError(f"{ENV_VAR}={explicit} does not hold {', '.join(missing)}")
        return folder.resolve()
    cached = cache_dir()
    if cached.exists():
        stale = _mismatches(cached)
        if not stale:
            return cached
        log(f"cached ONNX Runtime headers in {cached} do not match their pins ({', '.join(stale)}): fetching again")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            extract_verified(fetch_archive(pathlib.Path(tmp), log), cached)
    except (RuntimeError, OSError, tarfile.TarError) as error:
        raise RuntimeError(f"could not obtain the ONNX Runtime headers ({error}). Offline, set {ENV_VAR} to a "
                           f"folder with {', '.join(REQUIRED)} from onnxruntime >= 1.22, or copy {cached} from a "
                           "machine that has it") from error
    return cached


if __name__ == "__main__":
    try:
        print(find_headers())
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
