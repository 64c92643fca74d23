"""``kvcache-op serve``'s model resolution and refusals, without starting a server: a checkpoint folder is exported
once and reused until its files change; an exported file finds its tokenizer beside it or through its metadata;
what cannot be served is refused in one line."""

import os
import re
import pathlib

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from conftest import copy_checkpoint  # noqa: E402
from kvcache_op.cli import build_parser, main  # noqa: E402
from kvcache_op.export_command import tokenizer_folder  # noqa: E402
from kvcache_op.serve_command import API_KEY_VARIABLE, api_key_of, resolve_model  # noqa: E402


def test_a_checkpoint_folder_is_exported_once_then_reused_until_it_changes(served_checkpoint, tmp_path):
    folder = served_checkpoint[0]
    said = []
    path, tokenizer = resolve_model(folder, cache_dir=tmp_path, progress=said.append)
    assert path.is_file() and tokenizer == folder and any("[2/3] exporting" in line for line in said)
    said.clear()
    assert resolve_model(folder, cache_dir=tmp_path, progress=said.append)[0] == path
    assert said == [f"using the export of {folder} cached at {path}"]
    other, _ = resolve_model(folder, cache_dir=tmp_path, settings={"page_size": 8}, progress=said.append)
    assert other != path  # other settings: another export
    config = folder / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        assert resolve_model(folder, cache_dir=tmp_path, progress=said.append)[0] != path  # a changed file: re-export
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_an_exported_file_finds_its_tokenizer(served_checkpoint, tmp_path):
    folder = served_checkpoint[0]
    path, _ = resolve_model(folder, cache_dir=tmp_path, progress=lambda line: None)
    assert resolve_model(path)[1] == tokenizer_folder(path)  # beside it
    moved = tmp_path / "alone.onnx"
    moved.write_bytes(path.read_bytes())
    assert resolve_model(moved)[1] == pathlib.Path(str(folder.resolve()))  # the checkpoint its metadata names
    assert resolve_model(moved, tokenizer=tmp_path)[1] == tmp_path  # or the one given


@pytest.mark.parametrize("argv, message", [
    (["serve", "/nonexistent/model.onnx"], "no exported model or checkpoint folder at /nonexistent/model.onnx"),
    (["serve", ".", "--host", "0.0.0.0"], "--host 0.0.0.0 is not loopback: pass --allow-remote"),
])
def test_what_cannot_be_served_is_refused_in_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_file_that_is_no_exported_decoder_is_refused_in_one_line_before_anything_starts(tmp_path, capsys):
    """A truncated file, and an ONNX file without the export's metadata, with or without replicas (whose Ray
    deployment would otherwise hide the reason)."""
    import onnx
    from onnx import TensorProto, helper

    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(b"\x08\x07\x12\xff\xff")
    plain = tmp_path / "plain.onnx"
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(plain))
    for argv, message in [([str(truncated)], "is not a readable ONNX file"),
                          ([str(truncated), "--tokenizer", str(tmp_path)], "is not a readable ONNX file"),
                          ([str(plain), "--tokenizer", str(tmp_path)], "carries no kvcache_op metadata"),
                          ([str(plain), "--tokenizer", str(tmp_path), "--replicas", "1"], "carries no kvcache_op")]:
        assert main(["serve", *argv, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_a_checkpoint_folder_without_a_tokenizer_is_refused_before_its_export(served_checkpoint, tmp_path, capsys):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((served_checkpoint[0] / name).read_bytes())
    cache = tmp_path / "cache"
    assert main(["serve", str(folder), "--cache-dir", str(cache)]) == 2
    captured = capsys.readouterr()
    assert "holds no tokenizer" in captured.err and captured.err.count("\n") == 1
    assert not cache.exists() and "exporting" not in captured.out


def test_export_settings_given_for_an_exported_file_are_refused(tmp_path, capsys):
    import hf_models

    for flags in (["--quant-bit", "8"], ["--page-size", "4", "--dtype", "float16"], ["--cache-dir", str(tmp_path)]):
        assert main(["serve", hf_models.exported("llama"), "--tokenizer", str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err
        assert f"{flags[0]}" in err and "set how a checkpoint folder is exported" in err and err.count("\n") == 1


def test_the_served_name_of_a_relative_folder_is_the_folders_own(tmp_path, monkeypatch):
    from kvcache_op.serve_command import served_name

    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path / "my-model")
    assert served_name(build_parser().parse_args(["serve", "."])) == "my-model"
    assert served_name(build_parser().parse_args(["serve", "../x.onnx"])) == "x"
    assert served_name(build_parser().parse_args(["serve", ".", "--model-name", "given"])) == "given"
    (tmp_path / "current.onnx").symlink_to(tmp_path / "llama-v2.onnx")  # a link names itself, as clients know it
    assert served_name(build_parser().parse_args(["serve", "../current.onnx"])) == "current"


def test_the_readme_quick_start_parses():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Serving over HTTP.*?```bash\n(.*?)```", text, re.S).group(1)
    line = next(line for line in block.splitlines() if line.startswith("kvcache-op serve"))
    args = build_parser().parse_args(line.split("#")[0].split()[1:])
    assert args.command == "serve" and args.port == 8000 and args.host == "127.0.0.1"
    assert f"model='{pathlib.Path(args.model).name}'" in block  # the model id clients send: the folder's name


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    assert api_key_of(None) is None
    monkeypatch.setenv(API_KEY_VARIABLE, "from-env")
    assert api_key_of(None) == "from-env" and api_key_of("from-flag") == "from-flag"
    monkeypatch.setenv(API_KEY_VARIABLE, "")
    assert api_key_of(None) is None


def test_the_engine_flags_reach_the_engine():
    import hf_models
    from kvcache_op.serve_command import engine_options_of
    from kvcache_op.serving import Engine

    path = hf_models.exported("llama")
    args = build_parser().parse_args(["serve", "model.onnx", "--decode-steps", "3", "--max-running", "5",
                                      "--num-pages", "40"])
    options = engine_options_of(args)
    assert options["decode_steps"] == 3 and options["max_running"] == 5 and options["num_pages"] == 40
    engine = Engine(path, **options)
    assert (engine.decode_steps, engine.max_running, engine.num_pages) == (3, 5, 40)
    assert engine_options_of(build_parser().parse_args(["serve", "model.onnx"]))["decode_steps"] is None  # default


def test_an_empty_api_key_is_refused_not_taken_for_none(monkeypatch, capsys):
    """``--api-key "$KEY"`` with KEY unset would otherwise serve with no key (or with the environment's)."""
    monkeypatch.setenv(API_KEY_VARIABLE, "from-env")
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="--api-key is empty"):
            api_key_of(empty)
    assert main(["serve", "/nonexistent/model.onnx", "--api-key", ""]) == 2
    err = capsys.readouterr().err
    assert "--api-key is empty" in err and err.count("\n") == 1


def test_every_loopback_address_is_loopback():
    from kvcache_op.listening import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "::", "example.com", "128.0.0.1"))


def test_a_loopback_host_beyond_127_0_0_1_needs_no_allow_remote(capsys):
    assert main(["serve", "/nonexistent/model.onnx", "--host", "127.0.0.2"]) == 2
    assert "no exported model or checkpoint folder" in capsys.readouterr().err  # refused for the model, not the host


def test_threads_far_beyond_the_cores_are_refused(capsys):
    from kvcache_op.listening import usable_cores

    assert main(["serve", "/nonexistent/model.onnx", "--threads", str(4 * usable_cores() + 1)]) == 2
    err = capsys.readouterr().err
    assert "--threads" in err and "more than four times" in err and err.count("\n") == 1


def test_a_cache_folder_that_cannot_be_written_is_named_before_the_export(served_checkpoint, tmp_path, capsys):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("x")
    assert main(["serve", str(served_checkpoint[0]), "--cache-dir", str(not_a_folder), "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert f"the cache folder {not_a_folder} (--cache-dir, $KVCACHE_OP_CACHE) cannot take the export: " in captured.err
    assert captured.err.count("\n") == 1 and "exporting" not in captured.out


def test_a_damaged_tokenizer_is_refused_before_the_export(served_checkpoint, tmp_path, capsys):
    folder = copy_checkpoint(served_checkpoint[0], tmp_path / "bad-tokenizer")
    (folder / "tokenizer.json").write_text("{not json")
    cache = tmp_path / "cache"
    assert main(["serve", str(folder), "--cache-dir", str(cache), "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert f"cannot load the tokenizer in {folder}" in captured.err and captured.err.count("\n") == 1
    assert "loading" not in captured.out and not cache.exists()


def test_a_checkpoint_that_cannot_be_loaded_is_one_line_and_leaves_no_cache_entry(served_checkpoint, tmp_path,
                                                                                     capsys):
    """A truncated weight file: the export's child fails, the command says why in one line (no traceback), and the
    cache folder keeps nothing of the attempt."""
    folder = copy_checkpoint(served_checkpoint[0], tmp_path / "bad-weights", weights_bytes=1000)
    cache = tmp_path / "cache"
    assert main(["serve", str(folder), "--cache-dir", str(cache), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the checkpoint {folder}" in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and list(cache.iterdir()) == []
