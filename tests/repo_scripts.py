"""The repository's scripts that are not part of the installed package (build helpers in cmake/, GPU scripts in
tools/), imported from their files for the tests that check them."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(relative_path: str):
    """The module at ``ROOT/relative_path``, imported once (under its file's stem) and cached in sys.modules."""
    path = ROOT / relative_path
    name = "repo_script_" + path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
