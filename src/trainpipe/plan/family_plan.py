"""`trainpipe plan` for the tabular, image and custom families: the micro-batch rule, the memory of one training step and
the time of the run, measured the way the text planner measures a step (a fake-tensor trace, plan/module_trace.py).

- `auto_micro_batch(rows)`: `training.per_device_train_batch_size: auto` for these families, from the number of training
  rows: the largest power of two <= rows / STEPS_PER_EPOCH (so an epoch has at least that many optimizer steps), between
  MIN_BATCH and MAX_BATCH. plan/families.py applies it in the one resolver, so `plan` and `run` choose the same batch;
  the plan then traces the step at that batch and says whether it fits.
- `family_memory(cfg, micro_batch, hw)`: trainpipe's own models (the tabular MLP on the table's columns, an image
  classifier from `model.name_or_path`'s config with a head for the classes found) built on the meta device and traced
  on fake tensors at the planned micro-batch: peak bytes of one step (weights, gradients, AdamW states, activations),
  the FLOPs of one step (torch's FlopCounterMode on the same fake tensors) and the time of the run from them.
  A custom module is traced only when `trainpipe plan --trace` asks for it (that imports `model.factory` and
  `data.factory`, i.e. runs your code, as `trainpipe run` does); the tracer is train/supervised.py's `plan_trace`,
  handed in by the CLI.
- `TEXT_ONLY`: the decisions that mean nothing for these families (packing, attention kernel, max_length), left out of
  their plan and of what `run` prints (plan/families.py `family_decisions`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from trainpipe.data.images import check_image_sources
from trainpipe.data.sources import check_sources
from trainpipe.data.tabular import prepare_tabular
from trainpipe.errors import TrainpipeError
from trainpipe.model.images import is_timm, logits
from trainpipe.model.tabular import build_tabular_mlp
from trainpipe.plan.module_trace import trace_module_step
from trainpipe.plan.row_count import source_rows
from trainpipe.plan.trace import _materialize

STEPS_PER_EPOCH = 32  # an epoch of at least this many optimizer steps: small tables train by steps, not by batch size
MIN_BATCH, MAX_BATCH = 8, 256
TEXT_ONLY = ("model.attn_implementation", "data.packing", "data.max_length", "attn_implementation", "packing")
CPU_SHARE = 0.5  # the share of host RAM one process may plan to use on a machine without a GPU
RULE_STEPS = f"the largest power of two <= training rows / {STEPS_PER_EPOCH} (at least {STEPS_PER_EPOCH} optimizer steps an epoch), in [{MIN_BATCH}, {MAX_BATCH}]"


def auto_micro_batch(rows: int | None, fam: str) -> tuple[int, str]:
    """(micro-batch, the rule) for `per_device_train_batch_size: auto` from ``rows`` training rows (None: not known)."""
    if rows is None:
        return 64, (f"{fam} family: the training rows cannot be counted before the data step (`data.factory` is your code, which "
                    "the planner never runs, or a source that does not read here), so 64; set `training.per_device_train_batch_size` to choose")
    b = MIN_BATCH
    while b * 2 <= min(MAX_BATCH, rows / STEPS_PER_EPOCH):
        b *= 2
    return b, (f"{fam} family, {rows} training rows (the rows as stored less the eval/test shares, before the data step drops "
               f"duplicates and rejected rows): {RULE_STEPS}")


def _split_left(n: int, share: float) -> int:
    return n - (int(share) if share >= 1 else round(n * share))


def training_rows(cfg, fam: str) -> int | None:
    """The training rows the data step will keep, counted without decoding anything: the table's rows, the image files in
    the class folders or the rows of an image table, less the eval and test shares (None where only user code knows)."""
    d = cfg.data
    if d.factory is not None or not d.sources:
        return None
    try:
        n = sum(_count_source(s, fam) for s in d.sources if getattr(s, "role", "train") == "train")
    except Exception:  # noqa: BLE001 - a source that cannot be counted here is read (and its error said) by the data step
        return None
    return max(1, _split_left(_split_left(n, d.eval_split), d.test_split))


def _count_source(src, fam: str) -> int:
    p = Path(src.path or "")
    if fam == "image" and p.is_dir() and not any((p / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
        return sum(1 for c in p.iterdir() if c.is_dir() and not c.name.startswith(".") for f in c.rglob("*") if f.is_file() and not f.name.startswith("."))
    if fam == "image" and p.is_dir():
        import datasets

        return len(datasets.load_from_disk(str(p)))
    return source_rows(src)  # cheaply, once per file content (plan/row_count.py)


# ------------------------------------------------------------------------------ the traced step


def _budget(hw, gpu) -> tuple[int, str]:
    if gpu is not None:
        return int(gpu.memory_bytes), f"the {gpu.name}'s {gpu.memory_gib:g} GiB"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 * 1024**3
    return int(ram * CPU_SHARE), f"{int(CPU_SHARE * 100)} % of this machine's {ram / 1024**3:.0f} GiB RAM"


def _cpu_flops() -> float:
    """FLOP/s of this CPU on a 256 x 256 float32 matmul at the process's thread count, timed for 0.2 s."""
    import torch

    a = torch.randn(256, 256)
    a @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        a @ a
        n += 1
    return n * 2 * 256**3 / (time.perf_counter() - t0)


def step_flops(build, loss_of, batch: dict) -> float:
    """FLOPs of one forward + backward of ``build()`` on ``batch`` (fake tensors: nothing is computed)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with torch.random.fork_rng(devices=[]):
        with torch.device("meta"):
            model = build()
        with FakeTensorMode(allow_non_fake_inputs=True):
            _materialize(model, lambda shape, dtype, is_float: torch.empty(shape, dtype=dtype))
            model.train()
            with FlopCounterMode(display=False) as fc:
                loss_of(model, dict(batch)).backward()
    return float(fc.get_total_flops())


def builtin_tracer(cfg, fam: str, task: str):
    """(build, loss_of, make_batch(micro_batch)) of trainpipe's own model for ``cfg``, or None for a custom module."""
    if fam == "tabular":
        return _tabular(cfg, task)
    if fam == "image":
        return _image(cfg)
    return None


def _tabular(cfg, task: str):
    import torch
    import torch.nn.functional as F

    t = prepare_tabular(cfg.data, task=task, seed=cfg.training.seed)
    n_out = 1 if task == "regression" or cfg.method.loss == "bce" else len(t.prep.classes)

    def loss_of(m, b):
        out = m(b["x_num"], b["x_cat"])
        return F.cross_entropy(out, b["y"], reduction="sum") if n_out > 1 else F.mse_loss(out.squeeze(-1), b["y"].float(), reduction="sum")

    def batch(k: int) -> dict:
        rows = (t.train * (k // max(1, len(t.train)) + 1))[:k]
        return {"x_num": torch.tensor([e["x_num"] for e in rows], dtype=torch.float32).reshape(k, -1),
                "x_cat": torch.tensor([e["x_cat"] for e in rows], dtype=torch.long).reshape(k, -1),
                "y": torch.zeros(k, dtype=torch.long)}

    return (lambda: build_tabular_mlp(len(t.prep.numeric), t.prep.cardinalities, n_out, dict(cfg.model.args))), loss_of, batch


def _image(cfg):
    import torch
    import torch.nn.functional as F
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification

    m = cfg.model
    if is_timm(m.name_or_path):
        return None
    classes = _image_classes(cfg) or None
    kw = {"num_labels": classes} if classes else {}
    conf = AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code, revision=m.revision, **kw)
    proc = AutoImageProcessor.from_pretrained(m.name_or_path, revision=m.revision)
    one = proc(images=[Image.new("RGB", (64, 64))], return_tensors="pt")["pixel_values"][0]

    def batch(k: int) -> dict:
        return {"pixel_values": one.expand(k, *one.shape).clone(), "y": torch.zeros(k, dtype=torch.long)}

    return (lambda: AutoModelForImageClassification.from_config(conf)), \
        (lambda mod, b: F.cross_entropy(logits(mod, b["pixel_values"], True), b["y"], reduction="sum")), batch


def _image_classes(cfg) -> int:
    names = set()
    for s in cfg.data.sources:
        p = Path(s.path or "")
        if p.is_dir() and not (p / "dataset_info.json").exists() and not (p / "state.json").exists():
            names |= {c.name for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")}
    return len(names)


def family_memory(tracer, micro_batch: int, hw, gpu, *, rows: int | None, steps: int, effective_batch: int) -> dict:
    """The traced step at ``micro_batch`` with what fits and the run's time; ``tracer`` = (build, loss_of, make_batch)."""
    build, loss_of, make = tracer
    traced = trace_module_step(build, loss_of, make(micro_batch))
    flops = step_flops(build, loss_of, make(micro_batch))
    budget, where = _budget(hw, gpu)
    if gpu is not None:
        rate, rate_rule = gpu.peak_tflops("fp32") * 1e12 * 0.3, f"{gpu.name} fp32 peak at 30 % utilisation"
    else:
        rate = _cpu_flops()
        rate_rule = f"this CPU's measured 256x256 matmul rate, {rate / 1e9:.1f} GFLOP/s (small layers run slower: a lower bound)"
    windows = steps * max(1, effective_batch // max(1, micro_batch))
    return {**traced, "trace_seconds": traced["seconds"], "budget_bytes": budget, "budget": where, "fits": traced["peak_bytes"] <= budget, "step_flops": flops,
            "optimizer_steps": steps, "rows": rows, "seconds": float(f"{windows * flops / rate:.3g}") if rate > 0 else None, "rate_rule": rate_rule}


def planned_steps(cfg, rows: int | None, effective_batch: int) -> int | None:
    t = cfg.training
    if t.max_steps and t.max_steps > 0:
        return int(t.max_steps)
    if rows is None:
        return None
    return int(math.ceil(rows / max(1, effective_batch)) * t.num_train_epochs)


# ------------------------------------------------------------------------------ the plan's family section


def plan_family(out: dict, plan, hw, gpu, *, trace: bool = False, custom_tracer=None) -> None:
    """Fill ``out`` (plan/command.py's `--json` dict) for a tabular, image or custom config: drop the text-only decisions,
    show the micro-batch rule, and add `family` (the traced step: memory, FLOPs, time) with `fits`. ``custom_tracer(cfg,
    micro_batch)`` (train/supervised.py `plan_trace`, handed in by the CLI) traces a custom module under `--trace` only."""
    fam = next((d.value for d in plan.decisions if d.key == "model.family"), "text")
    if fam == "text":
        return
    rc = plan.config
    if rc.data is not None:  # a source that names nothing readable: the paragraph `trainpipe run` prints (run.py preflight), exit 2
        (check_image_sources if fam == "image" else check_sources)(rc.data.sources)
    task = next((d.value for d in plan.decisions if d.key == "method.task"), "classification")
    mb_rule = next((d.rule for d in plan.decisions if d.key == "training.per_device_train_batch_size"), None)
    rows_out = []
    for r in out["decision"]:
        if r["key"] in TEXT_ONLY:
            continue
        if r["key"] == "micro_batch" and mb_rule:
            r = {**r, "source": "planner", "rule": mb_rule}
        rows_out.append(r)
    out["decision"] = rows_out
    out["notes"] = [n for n in out["notes"] if "no CUDA GPU" not in n]
    mb, eff = int(plan.micro_batch.value), int(plan.effective_batch.value)
    rows = training_rows(rc, fam)
    steps = planned_steps(rc, rows, eff)
    if fam == "custom" and not trace:
        out["family"] = {"family": fam, "traced": False, "reason": (
            "measured when the run starts (a fake-tensor trace of your module at the planned micro-batch, printed and kept "
            "in summary.json `plan_trace`); `trainpipe plan --trace` shows it now by importing `model.factory` (it runs your code, like `run`)")}
        return
    try:
        tracer = custom_tracer(rc, mb) if fam == "custom" else builtin_tracer(rc, fam, task)
    except Exception as exc:  # noqa: BLE001 - bad input (a table that does not load) is the run's own paragraph, exit 2
        if fam == "custom" or isinstance(exc, TrainpipeError):
            raise
        out["family"] = {"family": fam, "traced": False, "reason": f"not traced: {type(exc).__name__}: {str(exc)[:200]}"}
        return
    if tracer is None:
        out["family"] = {"family": fam, "traced": False, "reason": "a timm model is traced when the run starts (plan does not build timm models)"}
        return
    mem = family_memory(tracer, mb, hw, gpu, rows=rows, steps=steps or 0, effective_batch=eff)
    out["family"] = {"family": fam, "traced": True, "micro_batch": mb, **mem, "seconds": mem["seconds"] if steps else None}
    out["memory"]["fits"] = {gpu.name if gpu is not None else "cpu RAM": mem["fits"]}
    if not mem["fits"]:
        out["fits"], out["why_not"] = False, (f"one training step at micro-batch {mb} needs {mem['peak_bytes'] / 1024**3:.2f} GiB but the plan has "
                                              f"{mem['budget']}; lower `training.per_device_train_batch_size` or `model.args`")


def family_lines(f: dict) -> list[str]:
    """The family section of the printed plan."""
    if not f.get("traced"):
        return [f"memory: {f['reason']}"]
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    lines = [f"memory: one training step at micro-batch {f['micro_batch']} peaks at {mib(f['peak_bytes'])} of tensors (weights "
             f"{mib(f['weights_bytes'])}, {f['parameters']:,} parameters; gradients, AdamW states and activations traced on fake tensors "
             f"in {f['trace_seconds']:.1f} s); "
             f"{'fits' if f['fits'] else 'does NOT fit'} in {f['budget']}"]
    if f.get("seconds") is not None:
        lines.append(f"time: {f['optimizer_steps']} optimizer steps x {f['step_flops']:.3g} FLOPs a micro-batch -> about {f['seconds']:.1f} s of compute "
                     f"({f['rate_rule']})")
    else:
        lines.append(f"time: {f['step_flops']:.3g} FLOPs a micro-batch; the number of steps is known when the data step has counted the rows")
    return lines
