"""What `trainpipe automl --task image-classification | text-classification | custom` knows of an arm before it trains:
its parameters, the memory of one training step and the measured time of one step, on this machine.

- images and custom modules: the model is built on the CPU from the arm's config (the backbone with its new head, or
  `model.factory(**model.args)`), its parameters counted; one training step at the arm's micro-batch on the family's own
  prepared examples (train/prepared_cache.py: the data step every arm's run reuses) is traced on fake tensors
  (plan/module_trace.py: the planner's memory, the figure `trainpipe run` prints) and then timed for real (forward and
  backward, the best of 5 after two warm-up steps);
- text classification: the planner's model spec gives the parameters and its plan the memory (plan/run_plan.py); the step
  is timed on a real micro-batch of `data.max_length` random token ids through AutoModelForSequenceClassification.

An arm is refused (listed in `candidates.csv` with the reason, never trained) when its parameters exceed
`automl.max_params`, its step exceeds `automl.max_step_ms`, or its memory exceeds `automl.memory_gib` (else the GPU less
the planner's headroom, or the CPU share of the RAM).
"""

from __future__ import annotations

import time

from trainpipe.config import RunConfig
from trainpipe.config.family import resolve_family
from trainpipe.data.image_transforms import load_image_processor
from trainpipe.model.images import TimmProcessor, is_timm, load_image_classifier
from trainpipe.plan import decisions as D
from trainpipe.plan.hardware import detect
from trainpipe.plan.module_trace import trace_module_step
from trainpipe.plan.resolve import CPU_MEMORY_SHARE, _ram_bytes, catalog_gpu
from trainpipe.plan.run_plan import plan_run
from trainpipe.train import supervised
from trainpipe.train.family import family
from trainpipe.train.image import ImageCrossEntropy, trace_step

WARMUP, TIMED = 2, 5


def memory_limit(gib: float | None) -> tuple[float, str]:
    """(bytes an arm may use, where the figure comes from)."""
    if gib is not None:
        return gib * 1024**3, f"`automl.memory_gib` {gib:g} GiB"
    gpu = catalog_gpu(detect())
    if gpu is not None:
        return gpu.memory_bytes * (1 - D.HEADROOM), f"{gpu.name} less {int(D.HEADROOM * 100)} % headroom"
    return _ram_bytes() * CPU_MEMORY_SHARE, f"{CPU_MEMORY_SHARE:.0%} of the RAM"


def _timed(step) -> float:
    """The best of TIMED runs of ``step`` after WARMUP, in milliseconds."""
    for _ in range(WARMUP):
        step()
    best = float("inf")
    for _ in range(TIMED):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _module_probe(build, objective, batch_of, traced: dict | None = None) -> dict:
    import torch

    with torch.random.fork_rng(devices=[]):  # the probe draws nothing from the run's random streams
        if traced is None:
            traced = trace_module_step(build, lambda m, b: objective.loss_sum(m, b)[0], batch_of())
        model = build()
        model.train()

        def step() -> None:
            loss = objective.loss_sum(model, batch_of())[0]
            loss.backward()
            model.zero_grad(set_to_none=True)

        ms = _timed(step)
    return {"params": int(sum(p.numel() for p in model.parameters())), "peak_bytes": (traced or {}).get("peak_bytes"), "step_ms": ms}


def probe(cfg: RunConfig) -> dict:
    """{"params", "peak_bytes" (None when not traced), "step_ms"} of one training step of ``cfg``'s model on this machine."""
    fam, _ = resolve_family(cfg.model, cfg.data)
    mb = cfg.training.per_device_train_batch_size
    if fam == "image":
        data = family("image").prepare(cfg)
        hf = not is_timm(cfg.model.name_or_path)
        processor = load_image_processor(cfg.model.name_or_path) if hf else TimmProcessor(load_image_classifier(cfg.model, data.classes))
        objective = ImageCrossEntropy(processor, {c: i for i, c in enumerate(data.classes)}, hf=hf, seed=cfg.training.seed, augment=False)
        traced = trace_step(cfg.model, data, objective, mb) if hf else {}  # the run's own trace (the classifier from its config)
        return _module_probe(lambda: load_image_classifier(cfg.model, data.classes), objective,
                             lambda: objective.collate(data.train[:mb], train=False), traced)
    if fam in ("custom", "tabular"):
        data = family(fam).prepare(cfg)
        objective = supervised.SupervisedObjective(supervised.default_loss(data.task, cfg.method.loss), data.task)
        return _module_probe(lambda: supervised.build_model(cfg, data)[0], objective, lambda: objective.collate(data.train[:mb]))
    return _text_probe(cfg, mb)


def _text_probe(cfg: RunConfig, mb: int) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    plan = plan_run(cfg, detect())
    mem = (plan.predicted or {}).get("memory") or {}
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForSequenceClassification.from_pretrained(cfg.model.name_or_path, num_labels=2, use_safetensors=True,
                                                                   trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision)
        model.config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        model.train()
        seq = cfg.first_data().max_length
        ids = torch.randint(0, model.config.vocab_size, (mb, seq))
        y = torch.zeros(mb, dtype=torch.long)

        def step() -> None:
            model(input_ids=ids, labels=y).loss.backward()
            model.zero_grad(set_to_none=True)

        ms = _timed(step)
    return {"params": int(sum(p.numel() for p in model.parameters())), "peak_bytes": mem.get("total_bytes"), "step_ms": ms}


def refusal(p: dict, max_params: float | None, max_step_ms: float | None, memory_gib: float | None) -> str | None:
    """Why an arm with probe ``p`` is not trained, or None."""
    if max_params is not None and p["params"] > max_params:
        return f"{p['params']:,} parameters > automl.max_params {max_params:,.0f}"
    limit, where = memory_limit(memory_gib)
    if p.get("peak_bytes") and p["peak_bytes"] > limit:
        return f"one training step needs {p['peak_bytes'] / 1024**3:.3f} GiB, {where} is {limit / 1024**3:.3f} GiB"
    if max_step_ms is not None and p["step_ms"] > max_step_ms:
        return f"one training step took {p['step_ms']:.1f} ms here > automl.max_step_ms {max_step_ms:g}"
    return None
