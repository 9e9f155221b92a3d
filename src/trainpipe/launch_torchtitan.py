"""Hand-off to torchtitan: `trainpipe launch CONFIG --emit torchtitan -o DIR` (the target row: trainpipe/targets.py).

Above what FSDP and ZeRO hold (the planner's > 100B rule, plan/parallel3d.py), or whenever one wants torchtitan's own
tensor, pipeline and context parallelism, trainpipe writes a launch script for torchtitan 0.3 instead of running the loop
itself. torchtitan 0.3 has no config file of its own: its config is a Python function of its model's config registry
(`--module llama3 --config llama3_70b`) plus command-line overrides of the `Trainer.Config` fields, parsed by its
`ConfigManager`. The script carries exactly that: the flavour of the model, then the overrides trainpipe's plan decides
(:func:`torchtitan_args`):

- the degrees: TP, PP and DP from the > 100B plan (TP x PP x DP = the GPUs), or the sequence degree of the long-context
  rule as torchtitan's context parallelism (plan/long_context.py), or FSDP over every GPU;
- the batch: the micro-batch as `training.local_batch_size`, the effective batch as `training.global_batch_size` (the
  accumulation follows), `data.max_length` as `training.seq_len`, the steps (`training.max_steps`, else the epochs over the
  data's records), clipping;
- the learning rate and its schedule (warmup steps, cosine / linear decay; constant as a floor of 1.0);
- activation checkpointing: full (`activation-checkpoint:full`), as the plan does at this scale;
- the Hugging Face checkpoint in (`checkpoint.initial_load_path` + `initial_load_in_hf`: torchtitan converts it on load)
  and out (`checkpoint.last_save_in_hf`); the script then completes the last step's safetensors into a Hugging Face folder
  (`hf-final/`: the weights plus the base's config and tokenizer files) that `trainpipe eval` and `trainpipe export` take;
- the data: torchtitan's local text loader (`c4_test`: `load_dataset(folder, split="train")`, the `text` field), given a
  folder holding the config's first data source, which must be a local JSONL/JSON/Parquet file of `text` rows.

The degrees and batch come from the same what-if plan `trainpipe plan` prints; the script's header repeats it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from trainpipe.errors import ConfigError
from trainpipe.launch import shell_join
from trainpipe.plan.request import WhatIf, whatif_from_config
from trainpipe.plan.whatif import make_plan

# Hugging Face model ids -> torchtitan's (module, config function) for the same architecture and size
FLAVOURS = [(re.compile(r"llama-?3(\.[0-9])?-(8b)", re.I), ("llama3", "llama3_8b")),
            (re.compile(r"llama-?3(\.[0-9])?-(70b)", re.I), ("llama3", "llama3_70b")),
            (re.compile(r"llama-?3(\.[0-9])?-(405b)", re.I), ("llama3", "llama3_405b"))]
DECAY = {"cosine": "cosine", "cosine_with_restarts": "cosine", "linear": "linear", "polynomial": "linear", "constant": "linear",
         "constant_with_warmup": "linear"}


def flavour(model: str) -> tuple[str, str]:
    """torchtitan's (module, config) for ``model``; one paragraph naming what it takes otherwise."""
    for pattern, out in FLAVOURS:
        if pattern.search(str(model)):
            return out
    raise ConfigError(
        f"`--emit torchtitan` writes torchtitan's config for a model flavour it ships, and `model.name_or_path: {model}` is not one "
        "trainpipe maps: Llama 3 / 3.1 / 3.3 at 8B, 70B or 405B (e.g. `meta-llama/Llama-3.1-70B`). Use one of those, or "
        "`--emit torchrun` to train with trainpipe's own loop.", ["model.name_or_path"])


def degrees(plan: dict, world: int) -> dict[str, int]:
    """torchtitan's parallelism degrees from the what-if plan: its TP x PP x DP, its sequence degree as context parallelism,
    else FSDP over every GPU."""
    par = plan.get("parallel") or {}
    tp, pp, cp = int(par.get("tensor") or 1), int(par.get("pipeline") or 1), int(par.get("sequence") or 1)
    return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": world // (tp * pp * cp), "tensor_parallel_degree": tp,
            "pipeline_parallel_degree": pp, "context_parallel_degree": cp}


def _data_source(cfg) -> Path:
    src = cfg.first_data().sources[0]
    path = Path(str(src.path or "")).expanduser()
    if not src.path or path.suffix not in (".jsonl", ".json", ".parquet"):
        raise ConfigError(
            f"`--emit torchtitan` hands torchtitan a local text dataset, and the first data source is `{src.path or src}`. Give "
            "`data.sources[0].path` a local JSONL, JSON or Parquet file whose rows have a `text` field (torchtitan's text loader "
            "reads that field; chat and instruction rows need torchtitan's own SFT recipe).", ["data.sources"])
    return path


def plan_for(cfg, *, gpus_per_node: int, nodes: int, accelerator: str) -> dict:
    """The what-if plan of ``cfg`` on the cluster (the one `trainpipe plan CONFIG --gpu ... --num-gpus ... --nodes ...` prints)."""
    wcfg, examples, avg = whatif_from_config(cfg, gpu=accelerator)
    return make_plan(wcfg, WhatIf(gpu=accelerator, num_gpus=gpus_per_node, nodes=nodes, examples=examples, avg_len=avg)) | {"examples": examples}


def torchtitan_args(cfg, plan: dict, *, world: int, hf_dir: str, data_dir: str, out_dir: str) -> list[str]:
    """The argv after `-m torchtitan.train`: the flavour, then the overrides of its `Trainer.Config` (the module docstring)."""
    module, config = flavour(cfg.model.name_or_path)
    t, rec = cfg.training, plan["recommendation"]
    effective = int(rec["effective_batch"])
    steps = t.max_steps if t.max_steps > 0 else (math.ceil(plan["examples"] * t.num_train_epochs / effective) if plan.get("examples") else 0)
    if steps <= 0:
        raise ConfigError("`--emit torchtitan` gives torchtitan a number of steps, and neither `training.max_steps` is set nor could the "
                          "data's records be counted. Set `training.max_steps`.", ["training.max_steps"])
    warmup = t.warmup_steps if t.warmup_steps is not None else math.ceil(t.warmup_ratio * steps)
    args = ["--module", module, "--config", config, "--hf_assets_path", hf_dir, "--dump_folder", out_dir]
    deg = degrees(plan, world)
    dp = deg["data_parallel_shard_degree"]
    # a pipeline needs micro-batches in flight: the whole per-replica batch is one local batch, cut into micro-batches of the
    # plan's size (>= 4 x PP of them keeps the bubble small); without a pipeline the local batch is the micro-batch
    pp = deg["pipeline_parallel_degree"]
    local = max(1, effective // dp) if pp > 1 else int(rec["micro_batch"])
    args += [x for k, v in deg.items() for x in (f"--parallelism.{k}", str(v))]
    if pp > 1:
        args += ["--parallelism.pipeline_parallel_microbatch_size", str(rec["micro_batch"]), "--training.disable_cuda_graphs"]  # torchtitan: none under PP
    args += ["--training.local_batch_size", str(local), "--training.global_batch_size", str(effective),
             "--training.seq_len", str(cfg.first_data().max_length), "--training.steps", str(steps), "--training.max_norm", str(t.max_grad_norm),
             "--optimizer.param_groups.0.optimizer_kwargs.lr", f"{float(rec['learning_rate']):.6g}",
             "--optimizer.param_groups.0.optimizer_kwargs.weight_decay", str(t.weight_decay),
             "--lr_scheduler.warmup_steps", str(min(warmup, max(steps - 1, 0))), "--lr_scheduler.decay_type", DECAY[t.lr_scheduler_type],
             "--lr_scheduler.min_lr_factor", "1.0" if t.lr_scheduler_type.startswith("constant") else "0.0",
             "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", data_dir,
             "--checkpoint.enable", "--checkpoint.folder", "checkpoint", "--checkpoint.interval", str(t.save_steps or max(1, steps // 4)),
             "--checkpoint.initial_load_path", hf_dir, "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf"]
    return args + ["activation-checkpoint:full"]  # a subcommand of torchtitan's parser: last


def emit_torchtitan(cfg, config_path: str, layout: dict, name: str, sets=(), *, accelerator: str = "H100") -> str:
    """The torchtitan launch script (every node runs it; torchrun's rendezvous on MASTER_ADDR joins them)."""
    g, n = int(layout["gpus_per_node"]), int(layout["nnodes"])
    data = _data_source(cfg)
    plan = plan_for(cfg, gpus_per_node=g, nodes=n, accelerator=accelerator)
    args = torchtitan_args(cfg, plan, world=g * n, hf_dir='"$HF"', data_dir='"$DATA"', out_dir='"$OUT"')
    argv = " ".join(a if a.startswith('"$') else shell_join([a]) for a in args)
    d = degrees(plan, g * n)
    lines = [f"trainpipe: torchtitan hand-off of {name} ({n} node(s) x {g} {accelerator}): TP {d['tensor_parallel_degree']} x PP "
             f"{d['pipeline_parallel_degree']} x CP {d['context_parallel_degree']} x DP {d['data_parallel_shard_degree']}, micro-batch "
             f"{plan['recommendation']['micro_batch']}, effective batch {plan['recommendation']['effective_batch']}",
             "the plan: " + "; ".join(f"{x['key']} {x['value']}" for x in plan["decision"] if x["key"] not in ("objective", "continued")),
             f"fits: {plan['fits']}" + ("" if plan["fits"] else f" ({plan.get('why_not')})")]
    head = "".join("# " + " ".join(str(x).split()) + "\n" for x in lines)  # one comment line each, whatever the values hold
    rdzv = "" if n == 1 else '--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR to the first node}:${MASTER_PORT:-29500}" '
    return (
        "#!/usr/bin/env bash\n" + head +
        "# needs: pip install torchtitan==0.3.0 (its own torch); HF: the base model's Hugging Face folder (weights, config, tokenizer)\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n'
        f'HF=${{HF:-{shell_join([str(cfg.model.name_or_path)])}}}\n'
        'OUT="${OUT:-torchtitan-out}"\n'
        'DATA="$OUT/data"\n'
        f'mkdir -p "$DATA" && cp -f {shell_join([str(data)])} "$DATA/"  # torchtitan reads the folder with load_dataset(folder, split="train")\n'
        f"torchrun --nnodes {n} --nproc-per-node {g} {rdzv}-m torchtitan.train {argv}\n"
        "# back to a Hugging Face folder that `trainpipe eval` and `trainpipe export` take: the last step's safetensors, the base's config and tokenizer\n"
        'LAST="$(ls -d "$OUT"/checkpoint/step-* | sort -t- -k2 -n | tail -1)"\n'
        'mkdir -p "$OUT/hf-final" && cp -f "$LAST"/*.safetensors* "$OUT/hf-final/"\n'
        'for f in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json; do\n'
        '  if [ -f "$HF/$f" ]; then cp -f "$HF/$f" "$OUT/hf-final/"; fi; done\n'
        'echo "trainpipe: the trained model is $OUT/hf-final (trainpipe eval / export take it)"\n'
    )


__all__ = ["FLAVOURS", "degrees", "emit_torchtitan", "flavour", "plan_for", "torchtitan_args"]
