"""``kvcache-op export``: a checkpoint folder (random weights saved with save_pretrained, a tokenizer trained here)
becomes a graph the engine serves with the model's own greedy tokens; the file records its source and the
tokenizer files are copied beside it; bad folders are refused in one line before anything slow."""

import onnx
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from conftest import copy_checkpoint  # noqa: E402
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
    stages = ["routed forward", "tracing it", "rewriting the graph", "GB of weights", "[3/3]"]
    at = [printed.find(text) for text in stages]
    assert -1 not in at and at == sorted(at), printed  # the export's own stages, in order, before the copying
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


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp.joinpath("out.onnx").mkdir() or tmp / "out.onnx", "is a folder: name the ONNX file to write"),
    (lambda tmp: tmp.joinpath("out.tokenizer").write_text("x") and tmp / "out.onnx",
     "is a file: the tokenizer files go to a folder of that name"),
])
def test_an_out_path_it_cannot_write_is_refused_before_the_export(checkpoint, tmp_path, capsys, make, message):
    folder, _ = checkpoint
    assert main(["export", str(folder), str(make(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and "[1/3]" not in captured.out


def test_a_checkpoint_without_weights_is_refused_in_one_line(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((folder / "config.json").read_bytes())
    assert main(["export", str(bare), str(tmp_path / "out.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache-op export: error:") and err.count("\n") == 1
    assert not (tmp_path / "out.onnx").exists()


def test_exporting_again_over_an_earlier_export_keeps_nothing_of_it(checkpoint, tmp_path, monkeypatch):
    """Another checkpoint exported to the same file: no tokenizer file of the first is left to be read as the
    second's; external weights are rewritten, not appended to; no partial file is left."""
    from kvcache_op.ort_ops import large_models

    folder, _ = checkpoint
    other = tmp_path / "other"
    other.mkdir()
    tiny_model("llama").save_pretrained(other)  # no tokenizer files
    out = tmp_path / "model.onnx"
    monkeypatch.setattr(large_models, "EXTERNAL_DATA_BYTES", 1000)  # the weights go to a data file beside it
    assert main(["export", str(folder), str(out)]) == 0
    first = _data_files(tmp_path)
    assert len(first) == 1 and (tokenizer_folder(out) / "tokenizer.json").is_file()
    size = first[0].stat().st_size
    assert main(["export", str(other), str(out)]) == 0
    data = _data_files(tmp_path)
    assert len(data) == 1 and data != first and data[0].stat().st_size == size  # rewritten whole, the old one gone
    assert not (tokenizer_folder(out) / "tokenizer.json").exists()
    assert (tokenizer_folder(out) / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.onnx", data[0].name, "model.tokenizer", "other"])
    prompt = [5, 6, 7]
    assert Engine(out, num_pages=8).generate([prompt], 3)[0] == reference_generate(
        tiny_model("llama").from_pretrained(other), prompt, 3)


def _data_files(folder) -> list:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".data"))


@pytest.mark.parametrize("external", [False, True])
def test_a_failed_export_leaves_the_earlier_file_and_its_weights_as_they_were(checkpoint, tmp_path, monkeypatch,
                                                                            external):
    """Over nothing: no file. Over an earlier export: that export, whole, still serving its own model's tokens
    (with its weights in a data file too: the new weights never go where the old file reads them)."""
    from kvcache_op.ort_ops import large_models

    folder, model = checkpoint
    out = tmp_path / "model.onnx"
    if external:
        monkeypatch.setattr(large_models, "EXTERNAL_DATA_BYTES", 1000)
    import onnx_ir

    save = onnx_ir.save

    def broken(model, path, **kwargs):
        save(model, path, **kwargs)  # the whole export written (its weights too), then the disk filled
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(onnx_ir, "save", broken)
    assert main(["export", str(folder), str(out)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(onnx_ir, "save", save)
    assert main(["export", str(folder), str(out)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    other = tmp_path.parent / f"{tmp_path.name}-other"
    other.mkdir()
    tiny_model("llama").save_pretrained(other)
    monkeypatch.setattr(onnx_ir, "save", broken)
    assert main(["export", str(other), str(out)]) == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    prompt = [5, 6, 7]
    assert Engine(out, num_pages=8).generate([prompt], 3)[0] == reference_generate(model, prompt, 3)


def test_an_out_path_that_is_a_file_of_the_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    """Writing the export over the checkpoint's own config (or weights) would ruin the checkpoint it reads."""
    copy = copy_checkpoint(checkpoint[0], tmp_path / "copy")
    config = (copy / "config.json").read_bytes()
    for target in ("config.json", "model.safetensors"):
        assert main(["export", str(copy), str(copy / target)]) == 2
        err = capsys.readouterr().err
        assert f"is {target} of the checkpoint being exported" in err and err.count("\n") == 1
    assert (copy / "config.json").read_bytes() == config
    # a checkpoint folder named as the tokenizer folder of OUT: the copied files would land on its own
    named = copy.rename(tmp_path / "model.tokenizer")
    assert main(["export", str(named), str(tmp_path / "model.onnx")]) == 2
    err = capsys.readouterr().err
    assert "which is the checkpoint folder being exported" in err and err.count("\n") == 1


def test_a_checkpoint_whose_weights_cannot_be_read_is_refused_in_one_line(checkpoint, tmp_path, capsys):
    copy = copy_checkpoint(checkpoint[0], tmp_path / "damaged", weights_bytes=1000)
    assert main(["export", str(copy), str(tmp_path / "out.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the checkpoint {copy}" in err and "Traceback" not in err and err.count("\n") == 1


def test_a_checkpoint_file_that_is_a_link_is_not_written_over_either(checkpoint, tmp_path, capsys):
    """The Hugging Face cache keeps a snapshot's files as links into its blobs: the link is what a save would
    replace, so it counts as the checkpoint's file wherever it points."""
    folder, _ = checkpoint
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for path in folder.iterdir():
        if path.is_file():
            (blobs / path.name).write_bytes(path.read_bytes())
            (snapshot / path.name).symlink_to(blobs / path.name)
    config = (blobs / "config.json").read_bytes()
    assert main(["export", str(snapshot), str(snapshot / "config.json")]) == 2
    err = capsys.readouterr().err
    assert "is config.json of the checkpoint being exported" in err and err.count("\n") == 1
    assert (snapshot / "config.json").is_symlink() and (blobs / "config.json").read_bytes() == config
