"""The tabular and custom families, top to bottom: prepared examples (a table through data/tabular.py, or your
`data.factory` datasets) -> the model (trainpipe's MLP, or your `model.factory` module) -> the loss (`method.loss`) checked
on one batch -> the baseline: the trivial predictor (majority class / training mean) and the untrained model on the eval
split -> trainpipe's resilient loop (the same objective/stepper/strategy as every text recipe: DDP/FSDP/ZeRO, resume to
the bit, OOM halving, divergence rollback; the best checkpoint by the task metric) -> final metrics with the best
checkpoint (and the test split) -> export (export_family.py: safetensors, the fitted preprocessing, ONNX on demand).

`summary.json` `baseline` holds the trivial predictor's metrics, so `beats_baseline` means "beats guessing"; the untrained
model's are `untrained`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainpipe import ui
from trainpipe.config.family import resolve_task
from trainpipe.data.tabular import prepare_tabular
from trainpipe.errors import ConfigError, DataError
from trainpipe.evaluate import task_metrics
from trainpipe.export_family import decode, export_supervised, model_meta
from trainpipe.model.custom import NAMED_LOSSES, build_datasets, build_module, import_object
from trainpipe.model.loading import parameter_counts
from trainpipe.model.tabular import build_tabular_mlp
from trainpipe.plan.module_trace import trace_module_step
from trainpipe.track.manifest import write_json
from trainpipe.train.context import RunContext
from trainpipe.train.objectives import Objective
from trainpipe.train.sft import build_loop, train, worker_summary

EVAL_BATCH = 1024


@dataclass
class Prepared:
    """What the family's data step hands the recipe (and run.py writes as `data_report.json`)."""

    train: list
    eval: list
    test: list
    report: dict
    task: str
    classes: list[str] = field(default_factory=list)  # classification
    prep: object = None  # data/tabular.py Preprocessing (tables), None for `data.factory`
    target_mean: float = 0.0  # regression with `data.factory`: the training mean (the trivial predictor)


def prepare(cfg) -> Prepared:
    """The family's data step: a table (`data.sources` + `data.label`/`target`) or `data.factory`'s datasets."""
    task, _ = resolve_task(cfg.method, cfg.data)
    if cfg.data.factory is not None:
        return _factory_data(cfg.data.factory, task)
    t = prepare_tabular(cfg.data, task=task, seed=cfg.training.seed)
    return Prepared(t.train, t.eval, t.test, t.report, task, list(t.prep.classes), t.prep)


def _factory_data(spec: str, task: str) -> Prepared:
    import torch

    train_ds, eval_ds = build_datasets(spec)
    train, ev = [_item(train_ds[i], spec, i) for i in range(len(train_ds))], [_item(eval_ds[i], spec, i) for i in range(len(eval_ds))]
    classes, mean = [], 0.0
    ys = torch.stack([torch.as_tensor(e["y"]) for e in train])
    if task == "classification":
        if ys.dtype.is_floating_point or ys.dim() != 1:
            raise DataError(f"`data.factory: {spec}`: classification targets must be class indices (one integer per item), got {ys.dtype} of shape {tuple(ys.shape)}. Return integer labels, or set `method.task: regression`.")
        classes = [str(c) for c in range(int(ys.max()) + 1)]
    else:
        mean = float(ys.double().mean())
    report = {"family": "custom", "task": task, "factory": spec, "records_read": len(train) + len(ev), "records_kept": len(train) + len(ev),
              "dropped": {}, "rejected_total": 0, "sources": [], "splits": {"train": len(train), "eval": len(ev), "test": 0},
              "train_examples": len(train), "eval_examples": len(ev)}
    if classes:
        report["class_counts"] = {s: dict(sorted(__import__("collections").Counter(str(int(e["y"])) for e in rows).items())) for s, rows in (("train", train), ("eval", ev))}
    return Prepared(train, ev, [], report, task, classes, None, mean)


def _item(item, spec: str, i: int) -> dict:
    if isinstance(item, dict) and "y" in item:
        return {"x": {k: v for k, v in item.items() if k != "y"}, "y": item["y"]}
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return {"x": item[0], "y": item[1]}
    raise DataError(f"`data.factory: {spec}`: item {i} is a {type(item).__name__}; each item must be an `(inputs, target)` pair or a dict with `y`.")


# ------------------------------------------------------------------------------ the objective


class SupervisedObjective(Objective):
    """`method.loss` over a micro-batch, summed over its examples; weight = examples (so micro-batching stays exact)."""

    def __init__(self, loss: str, task: str):
        self.name, self.task = loss, task
        self.user = import_object(loss, "method.loss") if loss not in NAMED_LOSSES else None
        self._rows: dict[int, int] = {}  # id(example) -> its row in the stacked tensors (`stack`)
        self._stacked: tuple = ()
        self._source: list | None = None  # the list `stack` stacked: a window of it (train/window.py Rows) is gathered by index
        self.gathers_rows = False

    def stack(self, examples: list[dict]) -> None:
        """Stack a table's training examples into tensors once, so that a micro-batch of them is gathered by row rather
        than converted from Python lists every step (the same values: benchmarks/tabular_throughput.py)."""
        if examples and "x_num" in examples[0]:
            b = self._from_lists(examples)
            self._stacked, self._rows = (b["x_num"], b["x_cat"], b["y"]), {id(e): i for i, e in enumerate(examples)}
            self._source, self.gathers_rows = examples, True

    def weight(self, examples: list[dict]) -> int:
        return len(examples)

    def tokens(self, examples: list[dict]) -> int:
        return len(examples)  # examples per second stand in for tokens per second in the logs

    def collate(self, examples: list[dict]) -> dict:
        import torch
        from torch.utils.data import default_collate

        if "x_num" in examples[0]:
            if self._source is not None and getattr(examples, "source", None) is self._source:
                idx = examples.rows  # a window of the stacked rows (the loop's Rows): their indices, no per-example work
            else:
                rows = [self._rows.get(id(e)) for e in examples] if self._rows else [None]
                if None in rows:
                    return self._from_lists(examples)
                idx = torch.tensor(rows)
            return {"x_num": self._stacked[0][idx], "x_cat": self._stacked[1][idx], "y": self._stacked[2][idx]}
        batch = default_collate(examples)
        x = batch["x"]
        return {**x, "y": batch["y"]} if isinstance(x, dict) else {"x": x, "y": batch["y"]}

    def _from_lists(self, examples: list[dict]) -> dict:
        """A table's examples as tensors, through numpy (torch.tensor on nested lists is 2x slower)."""
        import numpy as np
        import torch

        n = len(examples)
        return {"x_num": torch.from_numpy(np.array([e["x_num"] for e in examples], dtype=np.float32).reshape(n, -1)),
                "x_cat": torch.from_numpy(np.array([e["x_cat"] for e in examples], dtype=np.int64).reshape(n, -1)),
                "y": torch.tensor([e["y"] for e in examples], dtype=torch.long if self.task == "classification" else torch.float32)}

    def outputs(self, model, batch: dict):
        if "x_num" in batch:
            return model(batch["x_num"], batch["x_cat"])
        rest = {k: v for k, v in batch.items() if k != "y"}
        return model(rest["x"]) if set(rest) == {"x"} else model(**rest)

    def loss_of(self, out, y):
        import torch.nn.functional as F

        if self.user is not None:
            return self.user(out, y) * len(y)
        if self.name == "cross_entropy":
            return F.cross_entropy(out.float(), y.long(), reduction="sum")
        out = out.squeeze(-1) if out.dim() == y.dim() + 1 and out.shape[-1] == 1 else out
        if self.name == "bce":
            return F.binary_cross_entropy_with_logits(out.float(), y.float(), reduction="sum")
        return F.mse_loss(out.float(), y.float(), reduction="sum")

    def loss_sum(self, model, batch: dict):
        y = batch.pop("y")
        return self.loss_of(self.outputs(model, batch), y), {}


def default_loss(task: str, loss: str) -> str:
    return loss if loss != "auto" else ("cross_entropy" if task == "classification" else "mse")


def check_outputs(model, objective: SupervisedObjective, data: Prepared, where: str) -> None:
    """One forward and loss on two training examples: a mismatch is one paragraph naming the keys and shapes."""
    import torch

    batch = objective.collate(data.train[:2])
    y = batch["y"]
    try:
        with torch.no_grad():
            out = objective.outputs(model, {k: v for k, v in batch.items() if k != "y"})
            shape = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
            loss = objective.loss_of(out, y)
    except Exception as exc:  # noqa: BLE001 - the user's module or loss on a real batch: say what met what
        raise ConfigError(
            f"{where} on a batch of 2 training examples failed with `method.loss: {objective.name}`: {type(exc).__name__}: {str(exc)[:200]}. "
            f"The targets have shape {tuple(y.shape)}" + (f" and the task has {len(data.classes)} classes" if data.classes else "")
            + ". Make the module return one output per class for `cross_entropy` (shape [batch, classes]), one value per row for `mse`/`bce` "
            "(shape [batch] or [batch, 1]), or set `method.loss` to match what it returns."
        ) from None
    if objective.name == "cross_entropy" and data.classes and shape[-1:] != (len(data.classes),):
        raise ConfigError(
            f"{where} returns outputs of shape {shape}, but the training data has {len(data.classes)} classes ({', '.join(data.classes[:10])}): "
            f"`cross_entropy` needs [batch, {len(data.classes)}]. Give the module's last layer {len(data.classes)} outputs (e.g. `model.args.num_classes: {len(data.classes)}`)."
        )
    if not torch.isfinite(loss):
        raise ConfigError(f"{where} gives a non-finite loss ({float(loss)}) on the first training examples with `method.loss: {objective.name}`; check the module's output and the targets.")


# ------------------------------------------------------------------------------ evaluation


def predict_outputs(model, objective: SupervisedObjective, rows: list, batch_size: int = EVAL_BATCH):
    """(outputs, targets) of ``rows``, in eval mode, on the model's device."""
    import torch

    was = model.training
    model.eval()
    device = next(model.parameters()).device
    outs, ys = [], []
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in objective.collate(rows[i : i + batch_size]).items()}
            ys.append(batch.pop("y").cpu())
            outs.append(objective.outputs(model, batch).float().cpu())
    model.train(was)
    return torch.cat(outs), torch.cat(ys)


def to_probs(out, loss: str):
    import torch

    if loss == "bce":
        p = torch.sigmoid(out.reshape(-1))
        return torch.stack([1 - p, p], dim=-1)
    return torch.softmax(out, dim=-1)


def metrics_of(out, y, objective: SupervisedObjective, data: Prepared) -> dict:
    """The loss (mean) and the task metrics of outputs ``out`` against ``y``, in the table's own units."""
    loss = float(objective.loss_of(out, y)) / max(len(y), 1)
    if data.task == "classification":
        return {"loss": loss, **task_metrics.classification(to_probs(out, objective.name), y.long(), data.classes)}
    pred = out.squeeze(-1) if out.dim() == y.dim() + 1 and out.shape[-1] == 1 else out
    scale, shift = (data.prep.target_std, data.prep.target_mean) if data.prep is not None else (1.0, 0.0)
    return {"loss": loss, **task_metrics.regression(pred * scale + shift, y * scale + shift)}


def evaluate(model, objective, data: Prepared, rows: list) -> dict:
    out, y = predict_outputs(model, objective, rows)
    return metrics_of(out, y, objective, data)


def trivial(objective, data: Prepared, rows: list) -> dict:
    """The predictor that needs no model, measured like the model: the training class frequencies (majority class), or
    the training mean."""
    import torch

    y = torch.stack([torch.as_tensor(r["y"]) for r in rows])
    ytr = torch.stack([torch.as_tensor(r["y"]) for r in data.train])
    if data.task == "classification":
        freq = torch.bincount(ytr.long(), minlength=len(data.classes)).double() / len(ytr)
        p = freq.clamp(1e-6, 1)
        out = (torch.log(p[1] / p[0]).reshape(1, 1) if objective.name == "bce" else torch.log(p).reshape(1, -1)).float().expand(len(y), -1)
        m = metrics_of(out, y, objective, data)
        maj = int(freq.argmax())
        return {**m, "kind": "classes", "majority_class": data.classes[maj], "majority_accuracy": float((y.long() == maj).double().mean()),
                "eval_examples": len(y)}
    mean = float(ytr.double().mean()) if data.prep is not None else data.target_mean  # tables: in the model's standardised units
    out = torch.full(tuple(y.shape), mean, dtype=torch.float32)
    shown = data.prep.target_mean if data.prep is not None else mean
    return {**metrics_of(out, y, objective, data), "kind": "mean", "train_mean": shown, "eval_examples": len(y)}


# ------------------------------------------------------------------------------ the recipe


def build_model(cfg, data: Prepared):
    """trainpipe's tabular MLP, or `model.factory(**model.args)`."""
    if cfg.model.factory is not None:
        return build_module(cfg.model.factory, dict(cfg.model.args)), "model.factory `" + cfg.model.factory + "`"
    n_out = 1 if data.task == "regression" or cfg.method.loss == "bce" else len(data.classes)
    return build_tabular_mlp(len(data.prep.numeric), data.prep.cardinalities, n_out, dict(cfg.model.args)), "the tabular MLP"


def plan_trace(cfg, micro_batch: int):
    """`trainpipe plan --trace` on a custom module: (build, loss_of, make_batch) for plan/family_plan.py. This runs the
    user's code (`data.factory` and `model.factory` are imported and called, as `trainpipe run` does)."""
    data = prepare(cfg)
    model, where = build_model(cfg, data)
    objective = SupervisedObjective(default_loss(data.task, cfg.method.loss), data.task)
    check_outputs(model, objective, data, where)
    return (lambda: build_model(cfg, data)[0]), (lambda m, b: objective.loss_sum(m, b)[0]), \
        (lambda k: objective.collate((data.train * (k // len(data.train) + 1))[:k]))


def run(ctx: RunContext) -> dict:
    import torch

    cfg, data = ctx.cfg, ctx.data

    # 1. model and loss, checked together on one batch
    torch.manual_seed(cfg.training.seed)
    model, where = build_model(cfg, data)
    objective = SupervisedObjective(default_loss(data.task, cfg.method.loss), data.task)
    check_outputs(model, objective, data, where)
    objective.stack(data.train)
    if cfg.model.factory is None and objective.user is None:
        objective.step_rng = ("torch",)  # trainpipe's MLP and a named loss: a step draws only torch's RNG (dropout)
    micro = data.train[: ctx.specs.batch.micro_batch]
    traced = trace_module_step(lambda: build_model(cfg, data)[0], lambda m, b: objective.loss_sum(m, b)[0], objective.collate(micro))  # the planner's memory
    params = parameter_counts(model)
    ui.console().print(f"  {where}: {params['trainable']:,} trainable parameters; task {data.task}, loss {objective.name}"
                       + (f"; classes: {', '.join(data.classes[:10])}" if data.classes else ""), markup=False, soft_wrap=True)
    ui.console().print(f"  plan: one training step at micro-batch {traced['micro_batch']} peaks at {traced['peak_bytes'] / 2**20:.2f} MiB of tensors "
                       f"(weights {traced['weights_bytes'] / 2**20:.2f} MiB; fake-tensor trace, {traced['seconds']:.1f} s)", markup=False, soft_wrap=True)

    # 2. baseline: the trivial predictor (what `beats_baseline` compares with) and the untrained model, on the eval split
    base_trivial = trivial(objective, data, data.eval)
    objective.spike_floor = float(trivial(objective, data, data.train)["loss"])  # a loss spike is judged against guessing's loss at least
    baseline, _ = ctx.baseline_once(lambda: (task_metrics.scalars(base_trivial), []))
    untrained = task_metrics.scalars(evaluate(model, objective, data, data.eval)) if ctx.is_main else {}

    # 3. train in the resilient loop; the best checkpoint by `training.metric_for_best` (the plan's task metric)
    loop = build_loop(model, None, data.train, ctx.specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
                      evaluate=lambda m: task_metrics.scalars(evaluate(m, objective, data, data.eval)), objective=objective, dist=ctx.dist,
                      callbacks=ctx.callbacks)
    outcome = train(loop, ctx.resume_from)
    if not ctx.is_main:
        return worker_summary(cfg, outcome)

    # 4. final metrics with the best checkpoint loaded; the test split when there is one
    outputs, ys = predict_outputs(model, objective, data.eval)
    full = metrics_of(outputs, ys, objective, data)
    final = task_metrics.scalars(full)
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)
    test = task_metrics.scalars(evaluate(model, objective, data, data.test)) if data.test else None

    # 5. export: weights, the fitted preprocessing, what rebuilds the model
    meta = model_meta(cfg, data.task, objective.name, data.classes, data.prep)
    sample = {k: v for k, v in objective.collate((data.eval or data.train)[:2]).items() if k != "y"}
    model_dir = export_supervised(run_dir=ctx.run_dir, model=model, meta=meta, prep=data.prep, card=ctx.card(baseline, final), sample=sample)
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    preds = decode(outputs, meta, data.prep)  # what the final eval predicted, row by row, decoded as `trainpipe predict` decodes
    write_json(ctx.run_dir / "eval_predictions.json", [{"source": r.get("source"), "line": r.get("line", i), **p} for i, (r, p) in enumerate(zip(data.eval, preds))],
               what="the final eval's predictions `eval_predictions.json`")
    return {
        "name": cfg.name, "method": f"{meta['family']}/{data.task}", "family": meta["family"], "task": data.task, "loss": objective.name,
        "classes": data.classes, "baseline": baseline, "untrained": untrained, "final": final, **({"test": test} if test else {}),
        "trivial": {k: v for k, v in base_trivial.items() if k not in ("confusion", "per_class", "predicted_vs_true")},
        "task_report": {k: full[k] for k in ("confusion", "per_class", "predicted_vs_true") if k in full},
        "train": asdict(outcome), "parameters": params, "plan_trace": traced, "data": ctx.data_summary(),
        "artifacts": {"run_dir": str(ctx.run_dir), "model": str(model_dir), "events": str(ctx.run_dir / "events.jsonl")},
    }
