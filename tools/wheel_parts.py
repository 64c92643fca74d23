"""Moves a large file (the onnxruntime-gpu wheel) to a machine without network in parts, and puts it
back together there only if every byte is right.

    python3 tools/wheel_parts.py split onnxruntime_gpu-1.31.1-...whl --out .ort-gpu --size-mb 60
    python3 tools/wheel_parts.py join .ort-gpu --out /tmp/wheels     # verifies, prints the wheel's path

``split`` writes ``NAME.part000``, ``NAME.part001``... and ``MANIFEST.json`` (the file's name, size and
SHA-256, and each part's size and SHA-256). ``join`` checks every part against the manifest, writes the
file, checks the whole file's SHA-256, and refuses (exit 1, naming the bad part) on any mismatch.
"""

import argparse
import hashlib
import json
import pathlib
import sys

MANIFEST = "MANIFEST.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(path: pathlib.Path, out: pathlib.Path, size_mb: float) -> list[pathlib.Path]:
    """Writes the parts and the manifest into ``out``; returns the parts' paths."""
    data = path.read_bytes()
    step = max(1, int(size_mb * 2**20))
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for index, start in enumerate(range(0, max(len(data), 1), step)):
        chunk = data[start:start + step]
        part = out / f"{path.name}.part{index:03d}"
        part.write_bytes(chunk)
        parts.append({"name": part.name, "size": len(chunk), "sha256": _sha256(chunk)})
    manifest = {"name": path.name, "size": len(data), "sha256": _sha256(data), "parts": parts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return [out / p["name"] for p in parts]


def join(folder: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Reassembles the file described by ``folder/MANIFEST.json`` into ``out``; ``ValueError`` naming the
    first part (or the whole) that does not match its recorded size and SHA-256."""
    manifest = json.loads((folder / MANIFEST).read_text())
    chunks = []
    for part in manifest["parts"]:
        path = folder / part["name"]
        if not path.is_file():
            raise ValueError(f"part {part['name']} is missing from {folder}")
        chunk = path.read_bytes()
        if len(chunk) != part["size"] or _sha256(chunk) != part["sha256"]:
            raise ValueError(f"part {part['name']} does not match the manifest (size {len(chunk)}, "
                             f"expected {part['size']}; or its SHA-256 differs): copy it again")
        chunks.append(chunk)
    data = b"".join(chunks)
    if len(data) != manifest["size"] or _sha256(data) != manifest["sha256"]:
        raise ValueError(f"{manifest['name']} reassembled to the wrong bytes (SHA-256 {_sha256(data)}, expected "
                         f"{manifest['sha256']})")
    out.mkdir(parents=True, exist_ok=True)
    target = out / manifest["name"]
    target.write_bytes(data)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="cut a file into parts with a manifest")
    s.add_argument("file", type=pathlib.Path)
    s.add_argument("--out", type=pathlib.Path, required=True)
    s.add_argument("--size-mb", type=float, default=60)
    j = sub.add_parser("join", help="verify the parts and reassemble the file")
    j.add_argument("folder", type=pathlib.Path)
    j.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            for part in split(args.file, args.out, args.size_mb):
                print(part)
        else:
            print(join(args.folder, args.out))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        print(f"wheel_parts: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
