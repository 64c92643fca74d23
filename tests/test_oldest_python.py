"""Every Python file of the checkout compiles on the oldest Python the package claims (``requires-python``), where
an interpreter of that version is found: a newer Python accepts syntax the oldest refuses (an async comprehension
inside a plain one is 3.11's), so running the tests on the newest alone would not see it."""

import glob
import os
import pathlib
import re
import shutil
import subprocess
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_COMPILE_ALL = """
import pathlib, sys
failures = []
for name in sys.argv[1:]:
    try:
        compile(pathlib.Path(name).read_text(encoding="utf-8"), name, "exec")
    except SyntaxError as error:
        failures.append(f"{name}:{error.lineno}: {error.msg}")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def _oldest_version() -> str:
    claim = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(3\.\d+)", claim)
    assert match, f"requires-python {claim!r}: expected '>=3.N'"
    return match.group(1)


def _interpreter(version: str):
    """A Python ``version`` interpreter that runs (pyenv's shim on PATH may name one it cannot start), or None."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which(f"python{version}")] + \
        sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", "python")), reverse=True)
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def test_every_python_file_compiles_on_the_oldest_python_claimed():
    version = _oldest_version()
    interpreter = _interpreter(version)
    if interpreter is None:
        pytest.skip(f"no Python {version} interpreter here (python{version} on PATH, or pyenv's)")
    tracked = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: the files to compile are git's tracked ones")
    files = [str(ROOT / name) for name in tracked.stdout.split("\0") if name]
    assert len(files) > 100, files
    result = subprocess.run([interpreter, "-c", _COMPILE_ALL, *files], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"these do not compile on Python {version}:\n{result.stdout}{result.stderr}"
