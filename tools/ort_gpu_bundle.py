"""A slim onnxruntime-gpu for one GPU architecture, small enough for a single 64 MiB transfer to a machine
without network.

    python3 tools/ort_gpu_bundle.py make onnxruntime_gpu-1.31.1-...whl --arch 90 --out .ort-gpu
    python3 tools/ort_gpu_bundle.py unpack .ort-gpu --out /tmp/ort-gpu     # verifies, prints the folder

The wheel (255 MB) is mostly ``libonnxruntime_providers_cuda.so``, whose CUDA kernels are stored once per GPU
architecture (sm_75, 80, 86, 89, 90, 120) in fat binaries. ``make`` zeroes the payloads of every architecture but
``--arch`` in place (in each fat binary that has ``--arch``; one without it is kept whole), so every offset in the library stays as it was and the zeroes compress to nothing. The CUDA
runtime loads the one image matching the device, so on that architecture the library behaves as the wheel's; on any
other it has no kernels (the bundle's name says which architecture it serves). It also leaves out what the Python
package does not load: the C-API library ``libonnxruntime.so.*`` (the Python module links ONNX Runtime in), the
TensorRT provider and the tool subpackages (``transformers``, ``quantization``, ``tools``). The result is one
``.tar.xz`` (about 60 MB) beside ``BUNDLE.json`` (its name, SHA-256, the wheel's name and the architecture kept). ``unpack`` checks the hash, refuses on a mismatch, and extracts the
package folder to put first on ``PYTHONPATH``.

Fat-binary layout (as the CUDA toolchain writes it): a header (magic 0xBA55ED50, u16 version 1, u16 header size 16,
u64 size of the entries) followed by entries, each a header (u16 kind, u16 version, u32 header size, u64 payload
size, ..., u32 architecture at byte 28) and its payload.
"""

import argparse
import hashlib
import io
import json
import pathlib
import struct
import sys
import tarfile
import zipfile

MANIFEST = "BUNDLE.json"
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
CUDA_PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
# Members of the wheel the Python package never loads: the C-API library, the TensorRT provider, and the tool
# subpackages (model optimizers, quantization, converters) that `import onnxruntime` and sessions never import (only
# the diagnostic print_debug_info reaches into onnxruntime.transformers); left out, the bundle leaves room under the
# device's 64 MiB for the checkout that travels with it.
LEFT_OUT = ("onnxruntime/capi/libonnxruntime.so.", "onnxruntime/capi/libonnxruntime_providers_tensorrt.so",
            "onnxruntime/transformers/", "onnxruntime/quantization/", "onnxruntime/tools/")


def prune_fatbins(data: bytearray, keep_arch: int) -> dict[int, int]:
    """Zeroes, in place, the payload of every entry of another architecture in each fat binary that holds an entry
    for ``keep_arch``; a fat binary without one is left whole (its PTX may be what the device compiles at load).
    Headers and offsets are untouched. Returns the payload bytes per architecture found. Raises ValueError when the
    data holds no fat binary or none for ``keep_arch`` (the result would have no kernels for it)."""
    found: dict[int, int] = {}
    pos = 0
    while (start := data.find(FATBIN_MAGIC, pos)) >= 0:
        pos = start + 4
        if start + 16 > len(data):
            break
        version, header, size = struct.unpack_from("<HHQ", data, start + 4)
        end = start + header + size
        if version != 1 or header != 16 or end > len(data):
            continue  # the magic's bytes inside other data
        entries, entry = [], start + header
        while entry + 32 <= end:
            entry_header, payload = struct.unpack_from("<IQ", data, entry + 4)
            body = entry + entry_header
            if entry_header < 32 or body + payload > end:
                raise ValueError(f"fat binary at byte {start}: entry at byte {entry} runs past its end")
            entries.append((struct.unpack_from("<I", data, entry + 28)[0], body, payload))
            entry = body + payload
        for arch, _, payload in entries:
            found[arch] = found.get(arch, 0) + payload
        if any(arch == keep_arch for arch, _, _ in entries):
            for arch, body, payload in entries:
                if arch != keep_arch:
                    data[body:body + payload] = bytes(payload)
        pos = end
    if not found:
        raise ValueError("no CUDA fat binary found")
    if keep_arch not in found:
        raise ValueError(f"no kernels for sm_{keep_arch}; the library has {sorted(found)}")
    return found


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make(wheel: pathlib.Path, arch: int, out: pathlib.Path) -> pathlib.Path:
    """Writes ``out/<wheel stem>-sm<arch>.tar.xz`` and ``out/BUNDLE.json``; returns the bundle's path."""
    out.mkdir(parents=True, exist_ok=True)
    bundle = out / f"{wheel.stem}-sm{arch}.tar.xz"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        if CUDA_PROVIDER not in names:
            raise ValueError(f"{wheel.name} has no {CUDA_PROVIDER}: not an onnxruntime-gpu wheel")
        with tarfile.open(bundle, "w:xz", preset=9) as tar:
            for name in names:
                if name.endswith("/") or name.startswith(LEFT_OUT):
                    continue
                data = bytearray(zf.read(name))
                if name == CUDA_PROVIDER:
                    found = prune_fatbins(data, arch)
                    others = ", ".join(f"sm_{a}" for a in sorted(found) if a != arch)
                    print(f"{name}: kept sm_{arch} ({found[arch] >> 20} MiB of kernels); {others} zeroed wherever a "
                          f"fat binary has sm_{arch}", file=sys.stderr)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mode = 0o755 if name.endswith(".so") or ".so." in name else 0o644
                tar.addfile(info, io.BytesIO(bytes(data)))
    manifest = {"bundle": bundle.name, "sha256": _sha256(bundle), "wheel": wheel.name, "arch": arch}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return bundle


def unpack(folder: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Checks the bundle in ``folder`` against its manifest and extracts it into ``out``; returns ``out``. Raises
    ValueError on a missing or altered bundle."""
    manifest = json.loads((folder / MANIFEST).read_text())
    bundle = folder / manifest["bundle"]
    if not bundle.is_file():
        raise ValueError(f"{bundle} is missing")
    if _sha256(bundle) != manifest["sha256"]:
        raise ValueError(f"{bundle.name}: SHA-256 differs from {MANIFEST}")
    out.mkdir(parents=True, exist_ok=True)
    # The "data" filter (no links out, no devices) exists from Python 3.11.4; before, the checked SHA-256 stands alone.
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(bundle, "r:xz") as tar:
        tar.extractall(out, **safe)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="wheel -> slim bundle for one architecture")
    m.add_argument("wheel", type=pathlib.Path)
    m.add_argument("--arch", type=int, required=True, help="compute capability to keep, e.g. 90 (H100/H200)")
    m.add_argument("--out", type=pathlib.Path, required=True)
    u = sub.add_parser("unpack", help="verify and extract; prints the folder")
    u.add_argument("folder", type=pathlib.Path)
    u.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    try:
        path = make(args.wheel, args.arch, args.out) if args.command == "make" else unpack(args.folder, args.out)
    except (ValueError, OSError, KeyError, tarfile.TarError, zipfile.BadZipFile) as err:
        print(f"ort_gpu_bundle: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
