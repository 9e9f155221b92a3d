"""export: the best checkpoint as a plain transformers model folder.

`model/` holds full weights as safetensors, the tokenizer with the chat template used in
training, a generation config that stops at the end-of-turn token, a model card, and
`adapter/` (the PEFT adapter alone, for every PEFT method). What the full weights are:

- `none`, `freeze`: the trained model itself;
- `lora`, `rslora`, `dora`, `ia3`: the adapter merged into a float32 reload of the base;
- `qlora`, `qlora8`: never merged into quantized weights: the base is reloaded unquantized in
  float32 and the adapter merged there (with a warning: the result differs from the trained,
  quantized model by the quantization error);
- `prompt_tuning`, `prefix_tuning`: virtual tokens cannot be merged into weights, so `model/`
  is a float32 copy of the base and the card says how to load it with `adapter/`.

It is written to `model.tmp/` and renamed at the end, so `model/` never holds half an export.

Nothing that is not ours is replaced (the ownership rule, ownership.py; issue 22): the destination
must be missing, empty or an earlier trainpipe export that its manifest (`.trainpipe-owned.json`)
proves unchanged; a `.trainpipe-export` marker or a model card proves nothing, and an earlier export
with a file of the user's inside (a `serve.py`) is refused, nothing touched. `--out DIR` outside the
run goes through ``ownership.replace_dir`` (built beside DIR, swapped in, the new tree fingerprinted
into DIR's own manifest); the run's own `model/` and `export/NAME` are proven by the run folder's
manifest. The destination may not be, hold or lie inside the run folder (but for the run's own
`model/` and `export/NAME`), the config, the base model or the data. A write that fails (a full
disk) removes the temporary folder, leaves the earlier export in place and ends in an
:class:`ExportWriteError`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path

from trainpipe import faults, ownership, pending, ui
from trainpipe.config import ModelConfig
from trainpipe.data import serve_template, vision_chat
from trainpipe.errors import RunDirError, TrainpipeError
from trainpipe.model.checkpoints import write_error
from trainpipe.model.loading import load_model
from trainpipe.ownership import MANIFEST as OWNED
from trainpipe.redact import redact_text
from trainpipe.rundir import unproven as run_unproven

MARKER = ".trainpipe-export"
EXIT_WRITE_FAILED = 74  # EX_IOERR


class ExportWriteError(TrainpipeError):
    """Writing the export failed (a full disk, a read-only folder); nothing was replaced."""

    exit_code = EXIT_WRITE_FAILED
    title = "export failed"


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_destination(final: Path, *, run_dir: Path, protect: list[tuple[str, Path]] = ()) -> None:
    """Refuse (RunDirError) an export destination whose replacement would destroy something that is not an export.

    ``protect`` names further paths (what, path) the export must neither be, hold nor lie inside:
    the config, the base model, the data. Inside ``run_dir`` only its own `model/` and `export/NAME` may be written.
    """
    final, run_dir = Path(os.path.abspath(final)).resolve(), Path(run_dir).resolve()
    fix = "Give `--out` a new folder, an empty one, or an earlier trainpipe export."
    if _within(run_dir, final):
        raise RunDirError(f"The export destination `{final}` is (or holds) the run folder `{run_dir}`: exporting there would replace the run, "
                          f"its checkpoints and logs, so it is refused and nothing was touched. {fix}")
    if _within(final, run_dir) and final != run_dir / "model" and final.parent != run_dir / "export":
        raise RunDirError(f"The export destination `{final}` lies inside the run folder `{run_dir}`, where only `model/` and `export/NAME` are "
                          f"exports; writing there could replace the run's checkpoints or logs, so it is refused and nothing was touched. {fix}")
    for what, path in protect:
        path = Path(os.path.abspath(path)).resolve()
        if _within(path, final) or _within(final, path):
            relation = "is" if path == final else ("holds" if _within(path, final) else "lies inside")
            raise RunDirError(f"The export destination `{final}` {relation} {what} `{path}`: exporting there would replace it, so it is "
                              f"refused and nothing was touched. {fix}")
    if final.exists() or final.is_symlink():
        if not final.is_dir() or final.is_symlink():
            raise RunDirError(f"The export destination `{final}` exists and is not a folder; trainpipe replaces only its own exports, so it is "
                              f"refused and nothing was touched. {fix}")
        bad = unproven(final, run_dir) if any(final.iterdir()) else []
        if bad:
            shown = ", ".join(f"`{n}`" for n in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise RunDirError(f"The export destination `{final}` holds {shown}, which trainpipe cannot prove it wrote (not listed with its "
                              f"content in `{OWNED}`): it is not a trainpipe export, or files were added to it or changed since; trainpipe "
                              f"replaces only its own unchanged exports, so it is refused and nothing was touched. {fix}")
    tmp = final.with_name(final.name + ".tmp")
    if _within(final, run_dir) and tmp.exists() and not _is_own_tmp(tmp):
        raise RunDirError(f"The export is written through `{tmp}` next to `{final}`, and that path holds something that is not an unfinished "
                          f"trainpipe export; it is refused and nothing was touched. Move `{tmp}` away, or give `--out` another folder.")


def unproven(final: Path, run_dir: Path) -> list[str]:
    """The entries of the existing export folder ``final`` that trainpipe cannot prove its own: inside the run folder (its
    `model/`, `export/NAME`) by the run's manifest, elsewhere by the folder's own (written by ``ownership.replace_dir``)."""
    final, run_dir = Path(final).resolve(), Path(run_dir).resolve()
    if not _within(final, run_dir):
        return ownership.foreign(final)
    rel = final.relative_to(run_dir).as_posix()
    return [n for n in run_unproven(run_dir) if n == rel or n.startswith(rel + "/") or rel.startswith(n + "/")]


def recorded(final: Path, run_dir: Path, names: tuple[str, ...] = ()) -> None:
    """Fingerprint an export just written (and ``names`` inside it, written after it: the gates' files) into the manifest
    that proves it: the run folder's for its own `model/` and `export/NAME` (left to the run's own seal while the run is
    writing them), the folder's own and its parent's for `--out` elsewhere."""
    final, run_dir = Path(os.path.abspath(final)), Path(run_dir).resolve()
    if not final.is_dir():
        return
    if _within(final.resolve(), run_dir):
        rel = final.resolve().relative_to(run_dir).as_posix()
        top = run_dir / rel.split("/")[0]
        if top.name not in ownership.read_manifest(run_dir)["pending"]:  # of what is there, only what is proven or was written now
            bad = set(ownership.foreign(run_dir)) - {f"{rel}/{n}" for n in names}
            ownership.record(top, accept=lambda r: f"{top.name}/{r}" not in bad or ownership.internal(r.rsplit("/", 1)[-1]))
        return
    for n in names:
        if (final / n).exists():
            ownership.record(final / n)
    ownership.record(final)


def _move_into(src: Path, dest: Path) -> None:
    """Every entry of ``src`` renamed into ``dest`` (siblings on one file system: no copy)."""
    for p in list(src.iterdir()):
        os.replace(p, dest / p.name)


def _is_own_tmp(tmp: Path) -> bool:
    """An unfinished export of ours: a folder with our marker, or empty (killed before the marker was written)."""
    return tmp.is_dir() and not tmp.is_symlink() and ((tmp / MARKER).is_file() or not any(tmp.iterdir()))


def _replace(tmp: Path, final: Path) -> None:
    """Move ``tmp`` to ``final``; an earlier export there is moved aside first and deleted only once the new one is in place."""
    old = None
    if final.exists():
        if any(final.iterdir()):
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
        else:
            final.rmdir()
    try:
        tmp.rename(final)
    except OSError:
        if old is not None:
            old.rename(final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_failed(exc: BaseException, tmp: Path, final: Path, run_dir: Path) -> ExportWriteError:
    err = write_error(exc, tmp.parent)
    why = f"{err.strerror or err} (errno {err.errno})" if err is not None else str(exc)
    before = "still holds the earlier export" if final.exists() else "was not created"
    return ExportWriteError(
        f"Writing the export to `{final}` failed: {why}. The unfinished `{tmp.name}` was removed and `{final}` {before}; the checkpoints "
        f"in `{run_dir / 'checkpoints'}` are intact. Free space on that disk (or choose another folder with `--out`), then export again "
        f"with `trainpipe export {run_dir}`."
    )


def stop_token_ids(tokenizer, template: str) -> list[int]:
    """Token ids that end a reply: the template's end-of-turn token and the EOS token."""
    ids = []
    if template == "chatml":
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(i for i in ids if i is not None))


MERGEABLE = ("lora", "rslora", "dora", "qlora", "qlora8", "ia3")
QUANTIZED = ("qlora", "qlora8")
PROMPT_LEARNING = ("prompt_tuning", "prefix_tuning")


def base_model_dir(base: ModelConfig) -> list[tuple[str, Path]]:
    """The base model's local folder (and `init_from_config`), as `protect` entries for :func:`check_destination`."""
    out = []
    for what, p in (("the base model", base.name_or_path), ("the model config", getattr(base, "init_from_config", None))):
        if p and Path(p).expanduser().exists():
            out.append((what, Path(p).expanduser()))
    return out


def export_model(*, run_dir: Path, model, tokenizer, base: ModelConfig, peft: str, stop_ids: list[int], card: dict, dest: Path | None = None,
                 protect: list[tuple[str, Path]] = (), adapter_from: Path | None = None) -> Path:
    """Write the export to ``dest`` (default ``run_dir/model``) through ``<dest>.tmp`` and a rename (:func:`export_folder`).

    ``protect``: further (what, path) the destination must keep clear of; ``adapter_from``: a saved adapter folder
    copied to ``adapter/`` (the multi-adapter export)."""
    final = Path(os.path.abspath(dest)) if dest is not None else Path(run_dir) / "model"
    with export_folder(final, run_dir=run_dir, card=card, protect=[*base_model_dir(base), *protect]) as tmp:
        _write(tmp, model=model, tokenizer=tokenizer, base=base, peft=peft, stop_ids=stop_ids, card=card)
        if adapter_from is not None:
            shutil.copytree(adapter_from, tmp / "adapter")
    return final


@contextmanager
def export_folder(final: Path, *, run_dir: Path, card: dict, protect: list[tuple[str, Path]] = ()):
    """Yield ``<final>.tmp`` (marked as ours) to write an export into; on success it replaces ``final``.

    Refuses (RunDirError) a destination that is not ours to replace (:func:`check_destination`); a failed write
    (a full disk) removes the temporary folder, leaves ``final`` as it was and raises ExportWriteError."""
    final = Path(os.path.abspath(final))
    check_destination(final, run_dir=run_dir, protect=protect)
    in_run = _within(final.resolve(), Path(run_dir).resolve())
    if in_run:  # the run's own `model/` or `export/NAME`: through `<final>.tmp`, a name the run registers as pending
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():  # an unfinished export of ours (check_destination refused anything else)
            shutil.rmtree(tmp)
    else:  # `--out` elsewhere: built under a name of its own, then swapped in by ownership.replace_dir
        tmp = final.parent / f".{final.name}.build-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        tmp.mkdir(parents=True)
        (tmp / MARKER).write_text(json.dumps({"trainpipe_version": card.get("trainpipe_version"), "run_dir": str(run_dir),
                                              "config_hash": card.get("config_hash"), "time": time.time()}) + "\n", encoding="utf-8")
        yield tmp
        faults.during_export_write()
        written: tuple[str, ...] = ()
        if in_run:  # what this writer produced, noted before the rename: only those files are sealed as the run's (issue 36)
            rel = final.resolve().relative_to(Path(run_dir).resolve()).as_posix()
            files = pending.tree(tmp, rel)
            ownership.expect(run_dir, files)
            written = tuple(k[len(rel) + 1:] for k in files)
            _replace(tmp, final)
        else:
            reads = [(Path(p), what) for what, p in protect]
            ownership.replace_dir(final, lambda t: _move_into(tmp, t), what="the export", reads=reads)
            tmp.rmdir()
        recorded(final, Path(run_dir), written)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, TrainpipeError) or write_error(exc, final.parent) is None:
            raise
        raise _write_failed(exc, tmp, final, Path(run_dir)) from None


def _write(tmp: Path, *, model, tokenizer, base: ModelConfig, peft: str, stop_ids: list[int], card: dict) -> None:
    if peft in MERGEABLE or peft in PROMPT_LEARNING:
        model.save_pretrained(tmp / "adapter", safe_serialization=True)
    if peft in MERGEABLE:
        from peft import PeftModel

        if peft in QUANTIZED:
            ui.console().print(
                f"[yellow]warning:[/] export: the adapter was trained on a {'4' if peft == 'qlora' else '8'}-bit base; it is merged into a "
                "float32 reload of the unquantized base (never into quantized weights), so the merged model differs from the "
                "trained one by the quantization error. `model/adapter` on the quantized base reproduces training exactly.",
                markup=True, soft_wrap=True,
            )
        base_model = load_model(base, "float32", on_accelerator=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft's merge calls a deprecated transformers property
            merged = PeftModel.from_pretrained(base_model, tmp / "adapter").merge_and_unload()
    elif peft in PROMPT_LEARNING:
        merged = load_model(base, "float32", on_accelerator=False)  # virtual tokens cannot be merged: the base, plus adapter/
    else:
        merged = model
    merged.generation_config.eos_token_id = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    merged.generation_config.pad_token_id = tokenizer.pad_token_id
    merged.config.pad_token_id = tokenizer.pad_token_id
    merged.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tokenizer, tmp)
    card = {**card, "chat_format": serve_template.describe(tokenizer, reasoning_of(tokenizer))}
    processor = vision_chat.processor_of(tokenizer)
    if processor is not None:  # a vision-language model: AutoProcessor loads the export as the base's (image settings too)
        processor.save_pretrained(tmp)
        card = {**card, "images": vision_chat.image_settings(processor)}
    (tmp / "README.md").write_text(model_card({**card, "loading": how_to_load(peft)}), encoding="utf-8")


def reasoning_of(tokenizer) -> str:
    """`data.reasoning` of the run that prepared data with ``tokenizer`` (data/prepare.py records it; `train` otherwise)."""
    return getattr(tokenizer, "trainpipe_reasoning", "train")


def save_tokenizer(tokenizer, folder: Path) -> None:
    """Save ``tokenizer`` with the chat template that serves as training rendered (data/serve_template.py): tools,
    tool calls and reasoning exactly as the training text had them. The live tokenizer keeps its template."""
    own = getattr(tokenizer, "chat_template", None)
    served = serve_template.export_template(tokenizer, reasoning_of(tokenizer))
    try:
        if served is not None:
            tokenizer.chat_template = served
        tokenizer.save_pretrained(folder)
    finally:
        tokenizer.chat_template = own


def how_to_load(peft: str) -> str:
    """The model card's loading section for `method.peft`."""
    plain = (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'model = AutoModelForCausalLM.from_pretrained("model")\ntokenizer = AutoTokenizer.from_pretrained("model")\n```\n'
    )
    if peft in PROMPT_LEARNING:
        return (
            f"Trained with `{peft}`: learned virtual tokens, which cannot be merged into the weights. This folder holds an "
            "unchanged float32 copy of the base (plain transformers loads it, **without** the learned tokens) and "
            "`adapter/`, the virtual tokens. Load both with PEFT:\n\n"
            "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'base = AutoModelForCausalLM.from_pretrained("model")\nmodel = PeftModel.from_pretrained(base, "model/adapter")\n'
            'tokenizer = AutoTokenizer.from_pretrained("model")\n```\n'
        ) + ("\nWith peft 0.21 and transformers 5, `PeftModel.generate` silently drops a prefix (it passes it as "
             "`past_key_values`, which generate's own `cache` overrides); `trainpipe.evaluate.evaluator.generate` decodes "
             "with the prefix as the initial key/value cache, as in training.\n" if peft == "prefix_tuning" else "")
    if peft in MERGEABLE:
        note = (" The adapter was trained on a quantized base and merged into the float32 unquantized base here; "
                "`adapter/` with the base loaded quantized as in training reproduces the trained model exactly.") if peft in QUANTIZED else ""
        return f"Trained with `{peft}`; the adapter is merged into float32 weights, so plain transformers loads the model:{note}\n\n" + plain + (
            "\nThe adapter alone is in `adapter/` (`PeftModel.from_pretrained(base, \"model/adapter\")`).\n"
        )
    return f"Trained with `{peft}` (the weights themselves changed); plain transformers loads it:\n\n" + plain


def model_card(card: dict) -> str:
    lines = [f"# {card.get('name', 'trainpipe model')}", "", f"Trained with trainpipe {card.get('trainpipe_version', '')}.", ""]
    lines += [f"- base model: `{card.get('base_model')}`", f"- method: {card.get('method')}", f"- config hash: `{card.get('config_hash')}`"]
    if card.get("checkpoint"):
        lines.append(f"- checkpoint: `{Path(card['checkpoint']).name}` (`{card['checkpoint']}`)")
    for f in card.get("data_files", []):
        lines.append(f"- data: `{f.get('path')}` sha256 `{f.get('sha256')}`")
    lines += ["", "## Metrics (eval split)", "", "| metric | baseline | final |", "|---|---|---|"]
    for k, v in card.get("final", {}).items():
        b = card.get("baseline", {}).get(k)
        lines.append(f"| {k} | {b:.4g} | {v:.4g} |" if isinstance(v, (int, float)) and isinstance(b, (int, float)) else f"| {k} | {b} | {v} |")
    if card.get("chat_format"):
        lines += ["", "## Chat format", "", card["chat_format"]]
    if card.get("images"):  # a vision-language model: the image settings its processor applies (load it with AutoProcessor)
        lines += ["", "## Images", ""] + [f"- {k}: `{v}`" for k, v in card["images"].items()]
    if card.get("loading"):
        lines += ["", "## Loading", "", card["loading"]]
    lines += ["", "## Resolved config", "", "```json", json.dumps(card.get("config", {}), indent=2), "```", ""]
    return redact_text("\n".join(lines))  # no credential (a database URL's password, a token) in a card that gets published
