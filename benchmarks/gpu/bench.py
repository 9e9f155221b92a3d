"""The GPU check in one command: trainpipe on a Llama-3.2-1B-shaped model against plain TRL, batching, Liger, the
planner's memory prediction, the `gpu_utilization` gate and GRPO's rollout share, into one JSON.

    bash benchmarks/gpu/run.sh                                  # on a GPU: benchmarks/results/gpu-DATE-GPU.json
    bash benchmarks/gpu/run.sh --cpu-smoke --out /tmp/x.json    # the same code path, tiny model, CPU, seconds

Every section runs in its own try: one that cannot run (no CUDA, a package not installed, a failed run, the time
budget spent) writes why into the JSON and the check goes on. The JSON is rewritten after every section, so even a
killed check leaves what it measured. A global time guard (`--budget-s`, counted from when run.sh started) stops
starting runs and cuts each run's timeout so the whole check ends in time (8 minutes on one H200 by default).

Sections (keys of `sections` in the JSON):
- `sft_vs_trl`: tokens/s and MFU (6 x params x tokens/s / the GPU's dense bf16 peak) of a full fine-tune through
  `trainpipe run` and through TRL's SFTTrainer on the same rows, micro-batch and max_length; the ratio trainpipe/TRL.
- `batching`: padded (`data.packing: none`), padding-free and packed tokens/s, ratios to padded.
- `liger`: `training.use_liger_kernel` off/on: tokens/s, peak allocated and reserved memory.
- `gpu_utilization`: the `gpu_utilization` quality gate's reading of the padded run.
- `planner`: the plan's predicted peak reserved memory against `torch.cuda.max_memory_reserved` for full, LoRA and
  QLoRA at two sequence lengths (packed rows, so every step is the planned shape), error in %.
- `grpo`: a GRPO step's rollout share (time generating / step time) with `generate`, and with vLLM where trainpipe
  and the machine have it.
- `long_context`: one sequence per GPU (sequence parallelism 1) at doubling lengths (packed rows, micro-batch 1, LoRA,
  gradient checkpointing) until a run fails: peak memory per GPU, tokens/s and the planner's prediction at each
  length, the longest that trained, and the sequence degree the planner's long-context rule would choose for the next.
  Sequence parallelism > 1 is not measured: it needs two GPUs or more, and the check runs on one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _runs  # noqa: E402
import _setup  # noqa: E402
from _runs import RunFailed  # noqa: E402

ROOT = HERE.parent.parent
TARGETS = {"trainpipe_over_trl": ">= 1.0", "padding_free_over_padded_batch8": ">= 1.8", "mfu_1b_bf16_full": ">= 0.40",
           "planner_within_15pct": ">= 5 of 6 setups"}
RUN_CAP_S = 180.0  # the longest one run may take (a 1B full fine-tune run takes ~40 s on an H100-class GPU)


class Bench:
    """The result JSON and the clock."""

    def __init__(self, args, profile: _setup.Profile):
        self.args, self.p = args, profile
        self.start = args.started_at or time.time()
        self.deadline = self.start + (args.budget_s or profile.budget_s)
        self.out = Path(args.out) if args.out else None
        self.result = {"schema": 1, "command": "bash benchmarks/gpu/run.sh " + " ".join(sys.argv[1:]), "profile": profile.name,
                       "started": datetime.fromtimestamp(self.start, timezone.utc).isoformat(timespec="seconds"), "finished": False,
                       "budget_s": round(self.deadline - self.start), "targets": TARGETS, "environment": {}, "sections": {}}

    def left(self, reserve: float = 10.0) -> float:
        return self.deadline - time.time() - reserve

    def run_timeout(self) -> float:
        """One run's limit: what is left of the budget, and at most RUN_CAP_S (a hung run cannot take every later section)."""
        return min(self.left(), RUN_CAP_S)

    def write(self) -> None:
        self.result["elapsed_s"] = round(time.time() - self.start, 1)
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(self.out)

    def section(self, name: str, fn, *a, need_s: float = 0.0, **kw) -> dict:
        """Run one section in its own try; what it returns, or why it did not, goes into the JSON at once."""
        t = time.time()
        if self.left() < need_s:
            res = {"status": "skipped", "reason": f"time budget: {max(0, self.left()):.0f} s left, the section needs ~{need_s:.0f} s"}
        else:
            try:
                res = fn(*a, **kw)
            except RunFailed as exc:
                res = {"status": "error", "reason": str(exc)}
            except Exception as exc:  # noqa: BLE001 - a section that fails says why; the check goes on
                res = {"status": "error", "reason": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        res["seconds"] = round(time.time() - t, 1)
        self.result["sections"][name] = res
        self.write()
        print(f"[gpu-check] {name}: {res.get('status')} ({res['seconds']} s){' - ' + str(res.get('reason'))[:300] if res.get('reason') else ''}", flush=True)
        return res


def _pct(a, b):
    return round(100.0 * (a - b) / b, 1) if a is not None and b else None


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _figures(r: dict, params: int, gpu: dict) -> dict:
    keep = ("tokens_per_s", "loss_tokens_per_s", "timed_steps", "timed_seconds", "step_seconds", "final_loss", "cuda_max_memory_allocated",
            "cuda_max_memory_reserved", "model_dtype", "wall_s", "why", "tokens_note")
    return {k: r[k] for k in keep if k in r} | _setup.mfu(params, r.get("tokens_per_s"), gpu)


# --------------------------------------------------------------------------- sections
class Check:
    def __init__(self, bench: Bench, work: Path):
        self.b, self.p, self.work = bench, bench.p, work
        self.runs: dict[str, dict] = {}

    def setup(self) -> dict:
        import torch

        cuda = torch.cuda.is_available()
        if not cuda and not self.b.args.cpu_smoke:
            raise RuntimeError("no CUDA device: run on a GPU, or pass --cpu-smoke for the tiny CPU dry run")
        self.gpu = _setup.gpu_info()
        self.attn = _setup.attention_choice(cuda)
        self.data = self.work / "data.jsonl"
        data_stats = _setup.write_records(self.data, self.p)
        self.model_dir = self.work / "model"
        self.model = _setup.build_model(self.model_dir, self.p, "cuda" if cuda else "cpu")
        self.cuda = cuda
        env = {"gpu": self.gpu, "attention": self.attn, "data": data_stats, "model": self.model, "versions": _setup.versions(),
               "profile": {k: v for k, v in vars(self.p).items() if k not in ("model", "extra")}, "python": sys.version.split()[0]}
        self.b.result["environment"] = env
        return {"status": "ok"}

    def cfg(self, **dotted) -> dict:
        return _setup.run_config(self.p, self.model_dir, self.data, self.work / "cache", self.work / "runs" / "x", self.attn["implementation"], **dotted)

    def tp(self, name: str, **dotted) -> dict:
        r = _runs.trainpipe_run(self.cfg(**dotted), self.work, name, self.b.run_timeout(), self.p.isolate, self.p.warmup)
        self.runs[name] = r
        return r

    def sft_vs_trl(self) -> dict:
        """A full fine-tune through `trainpipe run` (padded batches) and through plain TRL SFTTrainer on the same rows;
        each side runs even when the other failed, and says why it has no figure."""
        out: dict = {"status": "ok", "batch": self.p.batch, "max_length": self.p.max_length, "attention": self.attn["implementation"],
                     "note": "same prepared rows (trainpipe's tokenisation, handed to SFTTrainer pre-tokenized), micro-batch, max_length, model dtype "
                             "and attention; tokens_per_s: input (non-pad) tokens, loss_tokens_per_s: the tokens that carry loss, counted the same "
                             "way on both sides; steps after the warm-up only; MFU = 6 x parameters x tokens_per_s / peak"}
        params = self.model["parameters"]
        try:
            tp = self.tp("padded", data__packing="none")
            params = (tp.get("parameters") or {}).get("total") or params
            out["trainpipe"] = _figures(tp, params, self.gpu)
        except RunFailed as exc:
            out["trainpipe"] = {"reason": str(exc)}
        cfg_path = self.work / "padded.yaml"  # written by the trainpipe run above, even when it failed
        try:
            out["trl"] = _figures(_runs.trl_run(cfg_path, self.work / "trl.json", self.b.run_timeout(), self.p.isolate, self.work, self.p.warmup),
                                  params, self.gpu)
        except RunFailed as exc:
            out["trl"] = {"reason": str(exc)}
        out["parameters"] = params
        out["ratio_trainpipe_over_trl"] = _ratio(out["trainpipe"].get("tokens_per_s"), out["trl"].get("tokens_per_s"))
        if out["ratio_trainpipe_over_trl"] is None:
            out["status"], out["reason"] = "partial", "a tokens/s figure is missing (see each side's `reason` or `why`)"
        return out

    def batching(self) -> dict:
        """Padded (dynamic padding to the batch's longest), padding-free and packed rows of the same data, tokens/s of
        real (non-pad) tokens and MFU each; a mode that fails (e.g. no attention path that keeps examples apart) says why."""
        out: dict = {"status": "ok", "batch": self.p.batch, "max_length": self.p.max_length, "attention": self.attn["implementation"]}
        padded = self.runs.get("padded")
        params = self.model["parameters"]
        out["padded"] = _figures(padded, params, self.gpu) if padded else {"reason": "the padded run of sft_vs_trl did not finish"}
        for mode in ("padding_free", "pack"):
            try:
                r = self.tp(mode, data__packing=mode)
                out[mode] = _figures(r, params, self.gpu) | {"ratio_over_padded": _ratio(r.get("tokens_per_s"), (padded or {}).get("tokens_per_s"))}
            except RunFailed as exc:
                out[mode], out["status"] = {"reason": str(exc)}, "partial"
        return out

    def liger(self) -> dict:
        if not self.cuda:
            return {"status": "skipped", "reason": "needs CUDA: Liger's kernels are Triton (trainpipe falls back to its chunked loss on the CPU)"}
        if not _setup.installed("liger_kernel"):
            return {"status": "skipped", "reason": "liger-kernel is not installed (pip install 'trainpipe[gpu]')"}
        off = self.runs.get("padded")
        if off is None:
            return {"status": "skipped", "reason": "the Liger-off run (sft_vs_trl's padded run) did not finish"}
        on = self.tp("liger", data__packing="none", training__use_liger_kernel=True)
        notes = [e for e in on.get("events", []) if "liger" in json.dumps(e).lower()]
        keys = ("tokens_per_s", "cuda_max_memory_allocated", "cuda_max_memory_reserved", "final_loss")
        return {"status": "ok", "off": {k: off.get(k) for k in keys}, "on": {k: on.get(k) for k in keys},
                "tokens_per_s_ratio_on_over_off": _ratio(on.get("tokens_per_s"), off.get("tokens_per_s")),
                "peak_allocated_change_pct": _pct(on.get("cuda_max_memory_allocated"), off.get("cuda_max_memory_allocated")),
                "peak_reserved_change_pct": _pct(on.get("cuda_max_memory_reserved"), off.get("cuda_max_memory_reserved")),
                "liger_events": notes[:5]}

    def gpu_utilization(self) -> dict:
        run = self.runs.get("padded")
        if run is None:
            return {"status": "skipped", "reason": "the padded run it reads did not finish"}
        gate = next((g for g in (run.get("gates") or {}).get("results", []) if g.get("name") == "gpu_utilization"), None)
        if gate is None:
            return {"status": "error", "reason": "the run's summary has no gpu_utilization gate result"}
        return {"status": "ok", "gate": gate, "samples": len(run.get("gpu_util_samples", [])),
                "mean_sampled_util": round(sum(run["gpu_util_samples"]) / len(run["gpu_util_samples"]), 1) if run.get("gpu_util_samples") else None,
                "nvml_installed": _setup.installed("pynvml")}

    def planner(self) -> dict:
        rows, errors = [], 0
        for seq in self.p.planner_seq:
            for peft in ("none", "lora", "qlora"):
                name = f"plan-{peft}-{seq}"
                dotted = {"data__packing": "pack", "data__max_length": seq, "training__per_device_train_batch_size": self.p.planner_batch,
                          "training__max_steps": self.p.planner_steps, "method__peft": peft}
                if peft != "none":
                    dotted["method__lora"] = {"r": 16, "alpha": 32}
                row = {"setup": {"method": "full" if peft == "none" else peft, "seq_len": seq, "micro_batch": self.p.planner_batch, "packing": "pack"}}
                if self.cuda and peft == "none" and seq == self.p.max_length and self.p.planner_batch == self.p.batch and "pack" in self.runs:
                    name = "pack"  # the packed run of `batching` is this very setup: its peak is read, not measured again
                try:
                    row |= self._plan_row(name, dotted)
                except Exception as exc:  # noqa: BLE001 - one row that fails says why; the others still run
                    errors += 1
                    row["reason"] = str(exc)[:800] if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}"[:800]
                rows.append(row)
        errs = [abs(r["error_pct"]) for r in rows if r.get("error_pct") is not None]
        out = {"status": "ok" if not errors and errs else ("partial" if errs else "no-measurement"), "rows": rows,
               "within_15pct": sum(1 for e in errs if e <= 15), "measured_rows": len(errs),
               "mean_abs_error_pct": round(sum(errs) / len(errs), 1) if errs else None}
        if not errs:
            out["reason"] = "no setup measured" + ("" if self.cuda else ": torch.cuda.max_memory_reserved needs a GPU (predictions only)")
        return out

    def _plan_row(self, name: str, dotted: dict) -> dict:
        if not self.cuda:  # the plan alone, as `trainpipe run` resolves it on this machine; nothing to measure against
            from trainpipe.config.load import build_config
            from trainpipe.plan.hardware import detect
            from trainpipe.plan.resolve import plan_run

            plan = plan_run(build_config(self.cfg(**dotted)), detect())
            return _predicted((plan.predicted or {}).get("memory")) | {"measured_reserved_bytes": None, "error_pct": None,
                                                                     "reason": "no CUDA: the prediction only (max_memory_reserved needs a GPU)"}
        r = self.runs[name] if name == "pack" else self.tp(name, **dotted)
        pred = _predicted(((r.get("plan") or {}).get("predicted") or {}).get("memory"))
        meas = r.get("cuda_max_memory_reserved")
        return pred | {"run": name, "measured_reserved_bytes": meas, "measured_allocated_bytes": r.get("cuda_max_memory_allocated"),
                       "error_pct": _pct(pred.get("predicted_reserved_bytes"), meas),
                       "allocated_error_pct": _pct(pred.get("predicted_allocated_bytes"), r.get("cuda_max_memory_allocated")), "wall_s": r.get("wall_s")}

    def long_context(self) -> dict:
        if not self.cuda and not self.b.args.cpu_smoke:
            return {"status": "skipped", "reason": "needs CUDA: the point is the GPU's memory at long sequences"}
        long_dir = self.work / "model-long"  # the same weights, positions up to 128k (rotary positions are computed per token)
        if not long_dir.exists():
            long_dir.mkdir()
            for f in self.model_dir.iterdir():
                if f.name != "config.json":
                    (long_dir / f.name).symlink_to(f)
            conf = json.loads((self.model_dir / "config.json").read_text())
            (long_dir / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 131072}))
        rows, longest = [], None
        for seq in self.p.long_seq:
            dotted = {"model__name_or_path": str(long_dir), "data__packing": "pack", "data__max_length": seq, "data__truncation": "truncate", "method__peft": "lora",
                      "method__lora": {"r": 16, "alpha": 32}, "training__per_device_train_batch_size": 1,
                      "training__gradient_checkpointing": True, "training__max_steps": 2}
            row: dict = {"seq_len": seq, "sequence_parallel": 1}
            try:
                r = self.tp(f"long-{seq}", **dotted)
                pred = _predicted(((r.get("plan") or {}).get("predicted") or {}).get("memory"))
                row |= {"peak_allocated_bytes": r.get("cuda_max_memory_allocated"), "peak_reserved_bytes": r.get("cuda_max_memory_reserved"),
                        "tokens_per_s": r.get("tokens_per_s"), **pred, "error_pct": _pct(pred.get("predicted_reserved_bytes"), r.get("cuda_max_memory_reserved"))}
                longest = seq
            except RunFailed as exc:
                row["reason"] = str(exc)[:600]
                rows.append(row)
                break
            rows.append(row)
        out = {"status": "ok" if longest else "no-measurement", "rows": rows, "longest_seq_len_sp1": longest,
               "sequence_parallel_gt1": "not run: a sequence group needs two GPUs or more, and this check has one"}
        try:
            out["planner_rule"] = self._sp_rule(rows, longest)
        except Exception as exc:  # noqa: BLE001 - the figures above stand without it
            out["planner_rule"] = {"reason": f"{type(exc).__name__}: {exc}"[:400]}
        return out

    def _sp_rule(self, rows: list[dict], longest: int | None) -> dict:
        """What the planner's long-context rule says for the first length that did not train (or twice the longest)."""
        from trainpipe.plan import long_context
        from trainpipe.plan.catalog import spec_from_config_dict
        from trainpipe.plan.gpus import find_gpu, gpu_from_device_name
        from trainpipe.plan.memory import Setup

        seq = next((r["seq_len"] for r in rows if r.get("reason")), (longest or 1024) * 2)
        spec = spec_from_config_dict("benchmark-1b", json.loads((self.model_dir / "config.json").read_text()), "benchmark")
        name = gpu_from_device_name(self.gpu.get("name") or "")
        gpu = find_gpu(name) if name else None
        s = Setup(method="lora", micro_batch=1, seq_len=seq, grad_ckpt=True, strategy="ddp", num_gpus=8)
        d = long_context.decide(spec, s, gpu, 8) if gpu else None
        return {"seq_len": seq, "gpus": 8, "decision": (d[0].value, d[0].rule) if d else None}

    def grpo(self) -> dict:
        """GRPO (LoRA) steps with the rollouts timed: through the model's `generate`, then through the colocated vLLM
        engine (`method.rl.rollout: vllm`) where the GPU has vLLM and trainpipe has the option."""
        G, prompts = 4, max(1, self.p.batch // 2)
        dotted = {"method__name": "rl", "method__peft": "lora", "method__lora": {"r": 16, "alpha": 32},
                  "method__rl": {"algorithm": "grpo", "reward_function": f"{HERE / 'reward_len.py'}:reward", "num_generations": G,
                                 "max_new_tokens": self.p.grpo_new_tokens},
                  "training__max_steps": self.p.grpo_steps, "training__per_device_train_batch_size": prompts,
                  "eval__max_samples": 4, "data__max_length": min(self.p.max_length, 512)}
        out: dict = {"status": "ok", "prompts_per_step": prompts, "num_generations": G, "max_new_tokens": self.p.grpo_new_tokens, "peft": "lora"}
        has_option = "rollout" in _rl_fields()
        for path in ("generate", "vllm"):
            why = self._vllm_reason(has_option) if path == "vllm" else None
            if why:
                out[path] = {"reason": why}
                continue
            if has_option:
                dotted["method__rl"] = dict(dotted["method__rl"], rollout=path)
            try:
                r = _runs.grpo_run(self.cfg(**dotted), self.work, f"grpo-{path}", self.b.run_timeout(), self.p.isolate,
                                   1)  # the first step (first generate, allocator warm-up) is left out
                out[path] = {k: r.get(k) for k in ("rollout_share", "generation_seconds", "step_seconds", "timed_steps", "generate_calls", "paths", "why", "wall_s")}
            except RunFailed as exc:
                out[path], out["status"] = {"reason": str(exc)}, "partial"
        if out.get("generate", {}).get("rollout_share") is None:
            out["status"] = "partial"
        return out

    def _vllm_reason(self, has_option: bool) -> str | None:
        if not self.cuda:
            return "needs CUDA (vLLM runs on a GPU)"
        if not _setup.installed("vllm"):
            return "not installed"
        if not has_option:
            return "vLLM is installed, but this trainpipe has no `method.rl.rollout: vllm`: generate only"
        return None


def _rl_fields() -> set[str]:
    from trainpipe.config.method import RLConfig

    return set(RLConfig.model_fields)


def _predicted(mem: dict | None) -> dict:
    """The plan's memory estimate as predicted reserved bytes (allocated + the allocator's fragmentation, setup.py's
    `Breakdown.reserved_bytes`)."""
    if not mem:
        return {"predicted_reserved_bytes": None, "reason": "the planner gave no memory estimate for this setup"}
    from trainpipe.plan.setup import FRAGMENTATION

    alloc = mem.get("allocated_bytes")
    frag = mem.get("fragmentation_bytes")
    reserved = alloc + frag if frag is not None else int(alloc * (1 + FRAGMENTATION))
    return {"predicted_allocated_bytes": alloc, "predicted_reserved_bytes": reserved, "predicted_total_bytes": mem.get("total_bytes")}


# --------------------------------------------------------------------------- main
def headline(sections: dict) -> dict:
    """The figures the targets name, gathered from the sections (None where a section has none)."""
    def get(*path):
        d = sections
        for k in path:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    mfus = [get("batching", m, "mfu") for m in ("padded", "padding_free", "pack")]
    return {
        "trainpipe_over_trl": get("sft_vs_trl", "ratio_trainpipe_over_trl"),
        "mfu_trainpipe_padded": get("sft_vs_trl", "trainpipe", "mfu"),
        "mfu_best_batching": max((m for m in mfus if m is not None), default=None),
        "padding_free_over_padded": get("batching", "padding_free", "ratio_over_padded"),
        "pack_over_padded": get("batching", "pack", "ratio_over_padded"),
        "liger_tokens_per_s_ratio": get("liger", "tokens_per_s_ratio_on_over_off"),
        "liger_peak_reserved_change_pct": get("liger", "peak_reserved_change_pct"),
        "planner_within_15pct": f"{get('planner', 'within_15pct')} of {get('planner', 'measured_rows')} measured" if get("planner", "measured_rows") else None,
        "gpu_utilization_gate": get("gpu_utilization", "gate", "status"),
        "rollout_share_generate": get("grpo", "generate", "rollout_share"),
        "rollout_share_vllm": get("grpo", "vllm", "rollout_share"),
    }


def default_out(gpu_name: str | None) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", (gpu_name or "cpu").replace("NVIDIA", "")).strip("-").lower() or "gpu"
    return ROOT / "benchmarks" / "results" / f"gpu-{datetime.now(timezone.utc):%Y-%m-%d}-{slug}.json"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny CPU dry run (every section, seconds)")
    ap.add_argument("--out", help="where the JSON goes (default on a GPU: benchmarks/results/gpu-DATE-GPU.json)")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole check's time budget in seconds (default: 450 on a GPU)")
    ap.add_argument("--started-at", type=float, default=None, help="epoch seconds the check started (run.sh passes it: setup counts)")
    ap.add_argument("--work", help="scratch folder (default: a new temporary folder, removed at the end)")
    ap.add_argument("--sections", default="sft_vs_trl,batching,gpu_utilization,planner,liger,grpo,long_context", help="which sections, in order")
    ap.add_argument("--isolate", action="store_true", help="--cpu-smoke too: each run in its own process, as on a GPU")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not args.out:
        import torch

        args.out = str(default_out(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None))
    if args.cpu_smoke and not args.out:
        ap.error("--cpu-smoke needs --out PATH (its figures are no GPU result and do not go to benchmarks/results/)")
    return args


NEED_S = {"sft_vs_trl": 30, "batching": 30, "gpu_utilization": 0, "liger": 20, "grpo": 20, "planner": 20, "long_context": 40}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    profile = _setup.Profile.smoke() if args.cpu_smoke else _setup.Profile.gpu()
    profile.isolate = profile.isolate or args.isolate
    if args.cpu_smoke:  # a tiny model gains nothing from several threads, and on a shared CPU their spin-waits cost seconds
        import torch

        torch.set_num_threads(1)
    bench = Bench(args, profile)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tp-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    check = Check(bench, work)
    bench.write()
    setup = bench.section("setup", check.setup)
    if setup.get("status") != "ok":
        bench.result["finished"] = True
        bench.write()
        return 1
    for name in args.sections.split(","):
        bench.section(name, getattr(check, name), need_s=0 if args.cpu_smoke else NEED_S.get(name, 20))
    bench.result["headline"] = headline(bench.result["sections"])
    bench.result["finished"] = True
    bench.write()
    print(f"[gpu-check] wrote {bench.out} in {time.time() - bench.start:.0f} s", flush=True)
    if not args.work:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written; skip the interpreter's teardown of the runs' libraries (seconds on a busy CPU)
