"""``kvcache-op export CHECKPOINT_DIR OUT.onnx``: a local transformers checkpoint folder to the packed decoder graph
the engine serves, with progress on the slow parts, the checkpoint's path recorded in the file, and its tokenizer
files copied beside it."""

from __future__ import annotations

import pathlib
import shutil
import time

#: What a server needs from the checkpoint besides the weights: the tokenizer, its chat template, the
#: end-of-sequence ids of the generation config.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json", "config.json")
#: The metadata key recording the checkpoint folder an exported file came from.
SOURCE_KEY = "kvcache_op.source_checkpoint"


def tokenizer_folder(out) -> pathlib.Path:
    """Where :func:`export_checkpoint` copies the tokenizer files of ``out``: ``OUT.tokenizer`` beside it."""
    out = pathlib.Path(out)
    return out.with_name(out.stem + ".tokenizer")


def export_checkpoint(checkpoint, out, *, page_size: int = 16, quant_bit: int = 0, dtype=None, cache_layout: int = 1,
                      fused_attention: bool = True, progress=print) -> dict:
    """Loads the causal LM in ``checkpoint`` (a local folder with a ``config.json``; float32), exports it to
    ``out`` with :func:`kvcache_op.hf.export_model` (the settings as there), records the folder in the file's
    metadata and copies its tokenizer files (those of :data:`TOKENIZER_FILES` it has) into
    :func:`tokenizer_folder`. ``progress(line)`` is told each stage and how long it took. Returns the path, the
    tokenizer folder, the files copied and the seconds taken. ``FileNotFoundError``/``ValueError`` naming the
    problem before anything slow runs."""
    from .hf import export_model, load_model

    checkpoint, out = pathlib.Path(checkpoint), pathlib.Path(out)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {checkpoint}")
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"{checkpoint} has no config.json: it is not a transformers checkpoint folder")
    _check_writable(out)
    _check_not_the_checkpoints_own(checkpoint, out)
    began = time.perf_counter()

    def stage(text):
        progress(f"{text} ({time.perf_counter() - began:.1f} s)")

    progress(f"[1/3] loading {checkpoint} in float32 ...")
    try:
        model = load_model(checkpoint)
    except ImportError:
        raise  # a missing optional module: the command names the extra that brings it
    except Exception as error:  # noqa: BLE001 - a damaged weight file, an inconsistent config: a line, not a traceback
        raise ValueError(f"cannot load the checkpoint {checkpoint}: {type(error).__name__}: {error}") from error
    stage(f"[2/3] exporting {model.config.num_hidden_layers} layers ({type(model).__name__}) to {out} ...")
    export_model(model, out, page_size=page_size, quant_bit=quant_bit, dtype=dtype, cache_layout=cache_layout,
                 fused_attention=fused_attention, metadata={SOURCE_KEY: str(checkpoint.resolve())},
                 progress=lambda text: stage(f"      {text} ..."))
    folder = tokenizer_folder(out)
    present = [name for name in TOKENIZER_FILES if (checkpoint / name).is_file()]
    stage(f"[3/3] copying {len(present)} tokenizer and config file(s) to {folder} ...")
    folder.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:  # an earlier export's files this checkpoint lacks would be read as its own
        if name not in present and (folder / name).is_file():
            (folder / name).unlink()
    for name in present:
        shutil.copy2(checkpoint / name, folder / name)
    seconds = time.perf_counter() - began
    progress(f"wrote {out} in {seconds:.1f} s")
    return {"path": str(out), "tokenizer_folder": str(folder), "copied": present, "seconds": seconds}


def _check_not_the_checkpoints_own(checkpoint: pathlib.Path, out: pathlib.Path) -> None:
    """``ValueError`` where writing ``out`` or its tokenizer folder would overwrite the checkpoint being read: ``out``
    an existing file of the checkpoint other than an ONNX file (its config, weights, tokenizer), or the tokenizer
    folder the checkpoint folder itself."""
    source = checkpoint.resolve()
    target = out.parent.resolve() / out.name  # the last link not followed: the save replaces the link itself
    if (target.exists() or target.is_symlink()) and target.suffix != ".onnx" and target.is_relative_to(source):
        raise ValueError(f"{out} is {target.relative_to(source)} of the checkpoint being exported: writing the export "
                         "there would overwrite it; name a new .onnx file")
    if tokenizer_folder(out).resolve() == source:
        raise ValueError(f"the tokenizer files of {out} go to {tokenizer_folder(out)}, which is the checkpoint folder "
                         "being exported: name the ONNX file otherwise")


def _check_writable(out: pathlib.Path) -> None:
    """``out`` and its tokenizer folder can be written, checked before the slow export: ``FileNotFoundError`` or
    ``ValueError`` saying why not."""
    from .torch.model_files import check_writable

    check_writable(out)
    folder = tokenizer_folder(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file: the tokenizer files go to a folder of that name")
