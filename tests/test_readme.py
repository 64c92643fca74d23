"""The README's usage example runs as written."""

import pathlib
import re

import pytest


def test_readme_usage_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Usage\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})


def test_readme_torch_example_runs():
    pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## PyTorch: eager ops and ONNX export\n.*?```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})


def test_readme_attention_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## MultiHeadAttention\n.*?```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
