"""``kvcache-op export``: a checkpoint folder (random weights saved with save_pretrained, a tokenizer trained here)
becomes a graph the engine serves with the model's own greedy tokens; the file records its source and the
tokenizer files are copied beside it; bad folders are refused in one line before anything slow."""

import onnx
import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from kvcache_op.cli import main  # noqa: E402
from kvcache_op.export_command import SOURCE_KEY, tokenizer_folder  # noqa: E402
from kvcache_op.hf import tiny_model  # noqa: E402
from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.serving import Engine, ModelInfo  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    model = tiny_model("llama")
    model.save_pretrained(folder)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2},
                                                                 unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, model


def test_export_writes_a_servable_graph_with_its_source_and_tokenizer(checkpoint, tmp_path, capsys):
    folder, model = checkpoint
    out = tmp_path / "model.onnx"
    assert main(["export", str(folder), str(out), "--page-size", "8"]) == 0
    printed = capsys.readouterr().out
    assert "[1/3] loading" in printed and "[3/3] copying" in printed and f"wrote {out}" in printed
    proto = onnx.load(str(out), load_external_data=False)
    props = {p.key: p.value for p in proto.metadata_props}
    assert props[SOURCE_KEY] == str(folder.resolve())
    assert ModelInfo.of_model(out).page_size == 8
    assert [n.op_type for n in proto.graph.node if n.op_type.startswith("MultiHead")] == \
        ["MultiHeadCacheAttention"] * model.config.num_hidden_layers
    copied = tokenizer_folder(out)
    assert (copied / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert (copied / "config.json").is_file()
    prompt = [5, 6, 7, 8, 9, 10]
    assert Engine(out, num_pages=8).generate([prompt], 6)[0] == reference_generate(model, prompt, 6)


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing", "no checkpoint folder at"),
    (lambda tmp: tmp, "has no config.json"),
])
def test_a_bad_checkpoint_folder_is_refused_in_one_line(tmp_path, capsys, make, message):
    assert main(["export", str(make(tmp_path)), str(tmp_path / "out.onnx")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_split_pair_is_one_flag_away(checkpoint, tmp_path):
    folder, model = checkpoint
    out = tmp_path / "split.onnx"
    assert main(["export", str(folder), str(out), "--split-attention", "--quant-bit", "8"]) == 0
    ops = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]
    assert ops.count("KeyValueCache") == ops.count("MultiHeadAttention") == model.config.num_hidden_layers
    assert ModelInfo.of_model(out).quant_bit == 8
