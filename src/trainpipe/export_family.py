"""The exported model of the tabular and custom families, and the loader `trainpipe predict` uses.

`RUN_DIR/model/` holds:

    model.safetensors     the weights (the best checkpoint's)
    trainpipe_model.json  what rebuilds the module: family, task, loss, classes, and the tabular MLP's shape and
                          `model.args` or your `model.factory` spec with its `model.args`
    preprocessing.json    tables: the preprocessing fitted on the training split (column kinds and rules, means and
                          standard deviations, category vocabularies, classes or the target's scale)
    README.md             the model card
    sample_inputs.safetensors  two eval examples as the module takes them (what `--onnx` traces and checks with)
    model.onnx            after `trainpipe export RUN --onnx` (checked against PyTorch with onnxruntime)

:func:`load_exported` rebuilds the module from these (a `model.factory` is imported again: predicting with your own
module runs your code) and :func:`predict_file` applies the saved preprocessing to a new table and writes the predictions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainpipe import ownership, rundir
from trainpipe.config.family import resolve_family
from trainpipe.data.tabular import Preprocessing, read_features
from trainpipe.errors import ConfigError
from trainpipe.export import MARKER as EXPORT_MARKER, export_folder, model_card
from trainpipe.model.custom import build_module
from trainpipe.model.tabular import build_tabular_mlp

META = "trainpipe_model.json"
PREP = "preprocessing.json"
SAMPLE = "sample_inputs.safetensors"


def model_meta(cfg, task: str, loss: str, classes: list[str], prep: Preprocessing | None) -> dict:
    family, _ = resolve_family(cfg.model, cfg.data)
    meta = {"format": 1, "family": family, "task": task, "loss": loss, "classes": list(classes), "args": dict(cfg.model.args)}
    if cfg.model.factory is not None:
        meta["factory"] = cfg.model.factory
    elif prep is not None:
        meta["tabular"] = {"numeric": len(prep.numeric), "cardinalities": prep.cardinalities,
                           "outputs": 1 if task == "regression" or loss == "bce" else len(classes)}
    meta["inputs"] = "table" if prep is not None else "factory"
    return meta


def export_supervised(*, run_dir: Path, model, meta: dict, prep: Preprocessing | None, card: dict, sample: dict | None = None,
                      dest: Path | None = None) -> Path:
    """Write the export (through `<dest>.tmp` and a rename: export.py `export_folder`). ``sample``: a collated batch of
    inputs (tensors by argument name; `x` alone is positional), saved for `--onnx`."""
    from safetensors.torch import save_file

    final = Path(dest) if dest is not None else Path(run_dir) / "model"
    with export_folder(final, run_dir=run_dir, card=card) as tmp:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if sample:
            save_file({k: v.detach().cpu().contiguous() for k, v in sample.items()}, str(tmp / SAMPLE), metadata={"order": ",".join(sample)})
        if prep is not None:
            (tmp / PREP).write_text(json.dumps(prep.to_dict(), indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(card), encoding="utf-8")
    return final


def model_folder(path: Path) -> Path:
    """A run directory's `model/`, or the model folder itself."""
    path = Path(path)
    folder = path / "model" if (path / "model" / META).is_file() else path
    if not (folder / META).is_file():
        raise ConfigError(f"`{path}` holds no exported tabular or custom model (no `{META}` in it or in `{path / 'model'}`); give the run directory of a finished run.")
    return folder


def load_exported(path: Path):
    """(module in eval mode, meta, preprocessing or None) of an exported folder (or a run directory)."""
    from safetensors.torch import load_file

    folder = model_folder(path)
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    prep = Preprocessing.from_dict(json.loads((folder / PREP).read_text(encoding="utf-8"))) if (folder / PREP).is_file() else None
    if "factory" in meta:
        model = build_module(meta["factory"], meta["args"])
    else:
        t = meta["tabular"]
        model = build_tabular_mlp(t["numeric"], t["cardinalities"], t["outputs"], meta["args"])
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.eval(), meta, prep


def table_outputs(model, prep: Preprocessing, features: list[dict]):
    """The model's raw outputs on prepared table features."""
    import torch

    n = len(features)
    x_num = torch.tensor([f["x_num"] for f in features], dtype=torch.float32).reshape(n, -1)
    x_cat = torch.tensor([f["x_cat"] for f in features], dtype=torch.long).reshape(n, -1)
    with torch.no_grad():
        return model(x_num, x_cat).float()


def decode(outputs, meta: dict, prep: Preprocessing | None) -> list[dict]:
    """One prediction per row: the class and its probabilities, or the value in the target's units."""
    import torch

    if meta["task"] == "classification":
        if meta["loss"] == "bce":
            p1 = torch.sigmoid(outputs.reshape(-1))
            probs = torch.stack([1 - p1, p1], dim=-1)
        else:
            probs = torch.softmax(outputs, dim=-1)
        classes = meta["classes"]
        return [{"prediction": classes[int(p.argmax())], **{f"prob_{c}": round(float(v), 6) for c, v in zip(classes, p)}} for p in probs]
    vals = outputs.reshape(len(outputs), -1)[:, 0]
    scale, shift = (prep.target_std, prep.target_mean) if prep is not None else (1.0, 0.0)
    return [{"prediction": float(v) * scale + shift} for v in vals]


def predict_file(path: Path, data: Path, out: Path) -> dict:
    """`trainpipe predict RUN --data FILE --out FILE`: the saved preprocessing on a new table, the predictions as CSV
    (the input's columns, then `prediction` and, for classes, one probability column each)."""
    import csv
    import io

    model, meta, prep = load_exported(path)
    if prep is None:
        raise ConfigError(f"`{path}` was trained on `data.factory` datasets, which have no table format to read `{data}` with; call the module from Python (`trainpipe.export_family.load_exported`).")
    rows, features = read_features(data, prep)
    preds = decode(table_outputs(model, prep, features), meta, prep) if rows else []
    buf = io.StringIO()
    cols = list(rows[0]) if rows else []
    extra = list(preds[0]) if preds else ["prediction"]
    w = csv.writer(buf)
    w.writerow(cols + [c for c in extra if c not in cols])
    for r, p in zip(rows, preds):
        w.writerow([r.get(c) for c in cols] + [p[c] for c in extra if c not in cols])
    ownership.write_text(Path(out), buf.getvalue(), what="the predictions", reads=[(Path(data), "the data to predict")])
    return {"rows": len(rows), "out": str(out), "family": meta["family"], "task": meta["task"]}


def export_onnx(path: Path, *, atol: float = 1e-4) -> dict:
    """`trainpipe export RUN --onnx`: `model.onnx` beside the weights, traced on the saved sample inputs (batch axis
    dynamic), then run with onnxruntime on those inputs and compared with PyTorch's outputs: the max absolute difference
    is reported, and one above ``atol`` is an error (the ONNX file is then not kept)."""
    import io
    import warnings

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        import onnxruntime as ort
    except ImportError:
        raise ConfigError("`--onnx` checks the export with onnxruntime, which is not installed: `pip install 'trainpipe[onnx]'`.") from None
    folder = model_folder(path)
    if not (folder / SAMPLE).is_file():
        raise ConfigError(f"`{folder}` has no `{SAMPLE}` to trace the module with; export it again with this version of trainpipe (`trainpipe run ... --overwrite`).")
    model, _, _ = load_exported(folder)
    sample = load_file(str(folder / SAMPLE))
    with safe_open(str(folder / SAMPLE), framework="pt") as f:
        names = f.metadata()["order"].split(",")  # the module's argument order (the file stores its tensors sorted by name)
    args = tuple(sample[n] for n in names)
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: no onnxscript needed, exact on these modules
            torch.onnx.export(model, args, buf, input_names=names, output_names=["outputs"], dynamo=False,
                              dynamic_axes={**{n: {0: "batch"} for n in names}, "outputs": {0: "batch"}})
    except Exception as exc:  # noqa: BLE001 - an operator ONNX cannot express: say so, keep the safetensors export
        raise ConfigError(f"The module in `{folder}` could not be exported to ONNX ({type(exc).__name__}: {str(exc)[:200]}); the safetensors export is unaffected.") from None
    session = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}  # an input the graph does not use (no categorical columns) is pruned
    got = session.run(None, {n: sample[n].numpy() for n in names if n in wanted})[0]
    with torch.no_grad():
        ref = model(*args).float().numpy()
    diff = float(abs(got - ref).max()) if ref.size else 0.0
    if diff > atol:
        raise ConfigError(f"The ONNX export of `{folder}` differs from PyTorch by up to {diff:.3g} (tolerance {atol:g}) on the sample inputs; `model.onnx` was not written.")
    write_beside(folder, "model.onnx", buf.getvalue())
    return {"path": str(folder / "model.onnx"), "max_abs_diff": diff, "inputs": names, "onnxruntime": ort.__version__}


def write_beside(folder: Path, name: str, data: bytes) -> None:
    """Add a file to an exported folder. A run's own `model/` is sealed in the run's manifest, so it is rebuilt the way the
    run wrote it (export.py `export_folder`: its files and the new one in `model.tmp/`, then renamed) between `rundir.begin`
    and `rundir.seal` under the run's lock: the folder stays provably the run's (a later `--overwrite` may clear it)."""
    run_dir = folder.parent
    if folder.name != "model" or not (run_dir / rundir.MARKER).is_file():
        ownership.write_bytes(folder / name, data, what=f"`{name}` beside the exported model")
        return
    with rundir.RunLock(run_dir):
        rundir.begin(run_dir)
        with export_folder(folder, run_dir=run_dir, card={"trainpipe_version": __import__("trainpipe").__version__}) as tmp:
            for f in folder.iterdir():
                if f.is_file() and f.name not in (rundir.MANIFEST, EXPORT_MARKER, name):
                    shutil.copy2(f, tmp / f.name)
            (tmp / name).write_bytes(data)
        rundir.seal(run_dir)
