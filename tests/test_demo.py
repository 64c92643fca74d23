"""The main job: ``kvcache-op demo`` exports, serves and verifies, and fails loudly on any mismatch."""

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from kvcache_op import demo  # noqa: E402
from kvcache_op.cli import main  # noqa: E402


def test_the_demo_serves_and_verifies_every_request(tmp_path, capsys):
    assert main(["demo", "--requests", "12", "--new-tokens", "6", "--num-pages", "10", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "OK: all 12 requests match the source model token for token" in out
    assert (tmp_path / "llama.onnx").exists()
    assert "per layer MultiHeadCacheAttention on one shared paged cache" in out  # the exporter's default form
    for figure in ("generated tokens/s", "prefix hits", "preemptions", "cache", "ONNX Runtime"):
        assert figure in out


def test_a_mismatch_fails_the_demo(tmp_path, capsys, monkeypatch):
    """The verification is real: a source model that disagrees on one request makes the exit status 1."""
    from kvcache_op.hf import verify

    real = verify.reference_generate
    monkeypatch.setattr(verify, "reference_generate",
                        lambda model, prompt, n, r=None: [t ^ 1 for t in real(model, prompt, n, r)] if len(prompt) % 2
                        else real(model, prompt, n, r))
    assert demo.run_demo(requests=6, new_tokens=4, num_pages=12, out_dir=str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "MISMATCH request" in out and "FAILED:" in out


def test_without_out_the_export_is_removed_at_the_end(tmp_path, capsys, monkeypatch):
    """Without ``--out`` the model goes into a temporary folder that the demo removes when it ends."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["demo", "--requests", "4", "--new-tokens", "3", "--num-pages", "10"]) == 0
    out = capsys.readouterr().out
    assert f"exported to {tmp_path}" in out and "removed at the end" in out
    assert list(tmp_path.iterdir()) == []


def test_more_pages_than_memory_holds_is_one_line(tmp_path, capsys):
    assert main(["demo", "--requests", "1", "--new-tokens", "1", "--num-pages", "100000000000",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache-op demo: error: num_pages=100000000000 pages") and err.count("\n") == 1, err
