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


def test_readme_serving_example_runs(tmp_path, monkeypatch):
    for module in ("torch", "transformers"):
        pytest.importorskip(module, reason="the serving example needs the 'hf' extra: pip install '.[hf]'")
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Serving a Hugging Face decoder\n.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "qwen2.onnx").exists()


def test_the_readme_test_command_is_what_ci_runs():
    root = pathlib.Path(__file__).parents[1]
    command = re.search(r"\n(pip install \"[^\n]*?) +# set up, then run the tests", (root / "README.md").read_text()).group(1)
    assert command.replace("pip install", "python3 -m pip install --quiet") in (root / ".ci" / "run").read_text()
