"""What is ours to silence stays silent: an export prints nothing of torch's exporter (its progress, its
"torchvision is not installed. Skipping ..." lines, warnings its own code raises), and ONNX Runtime does not
print an op's error a second time beside the exception that carries it. Real errors still raise."""

import subprocess
import sys

import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import run_model
from kvcache_op.validation.error_cases import INVALID, make_invalid


def test_an_export_prints_nothing(tmp_path):
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    script = ("from kvcache_op.hf import export_model, tiny_model\n"
              f"export_model(tiny_model('llama'), {str(tmp_path / 'm.onnx')!r})\n")
    done = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "" and done.stderr == "", (done.stdout + done.stderr)[-2000:]


def test_an_op_error_is_raised_once_and_not_printed_by_onnx_runtime(capfd):
    row = next(r for r in INVALID if r[0] == "start_pos_negative")
    inputs, attributes = make_invalid(row)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    with pytest.raises(Exception, match=row[3]):
        run_model(spec.make_model(inputs, **attributes), feeds)
    captured = capfd.readouterr()
    assert "onnxruntime" not in captured.err and "start_pos[1] = -1" not in captured.err, captured.err


def test_the_log_severity_can_be_raised_for_debugging(monkeypatch):
    from kvcache_op.ort_ops import session_options

    monkeypatch.setenv("KVCACHE_OP_ORT_LOG_SEVERITY", "0")
    assert session_options().log_severity_level == 0
    monkeypatch.setenv("KVCACHE_OP_ORT_LOG_SEVERITY", "loud")
    with pytest.raises(ValueError, match="expected 0 .verbose. .. 4 .fatal."):
        session_options()
