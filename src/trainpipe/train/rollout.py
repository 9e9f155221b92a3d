"""Who samples RL's completions (`method.rl.rollout`), and the per-prompt seeds that make every sample reproducible.

- `generate`: the training model's own `generate`, one call per prompt (its `num_generations` completions together)
  under that prompt's seed. Every device; the CPU path.
- `vllm`: a vLLM engine colocated on the training GPU (as TRL's `vllm_mode="colocate"`): built once with
  `enable_sleep_mode=True`, it sleeps (weights and KV cache released, level 2) while the model trains; before each
  rollout it wakes its weights, receives the policy's current weights through `load_weights` (a PEFT adapter merged
  first and unmerged after), wakes its KV cache, generates, and sleeps again. Each prompt is one request with
  `n = num_generations` and that prompt's seed.
- `auto`: vllm when vLLM is installed and the run is on CUDA without sharded weights, else generate; the rule and
  its reason are printed.

Per-prompt seeds (:func:`prompt_seeds`): the seed of a prompt is a hash of (`training.seed`, the rollout's index,
the prompt's token ids, which repeat of that prompt in the window it is). The same prompts at the same step get the
same seeds whatever the micro-batching, the process count or a resume in between, so a resumed run samples exactly
what the uninterrupted one sampled, and the sampling leaves the training RNG (dropout) untouched.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections import Counter

from trainpipe.errors import ConfigError


def prompt_seeds(seed: int, generation: int, prompts: list[list[int]]) -> list[int]:
    """One 63-bit sampling seed per prompt of a window (see the module docstring)."""
    seen: Counter = Counter()
    out = []
    for p in prompts:
        key = tuple(int(x) for x in p)
        k = seen[key]
        seen[key] += 1
        text = f"{seed}|{generation}|{k}|{','.join(map(str, key))}".encode()
        out.append(int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1))
    return out


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose_rollout(setting: str, *, device_type: str, installed: bool, sharded: bool = False) -> tuple[str, str]:
    """(`generate` or `vllm`, the reason) for `method.rl.rollout`; `vllm` asked for where it cannot run is a ConfigError."""
    if setting == "generate":
        return "generate", "method.rl.rollout: generate"
    problem = None
    if device_type != "cuda":
        problem = f"the run is on {device_type}, and vLLM needs a CUDA GPU"
    elif not installed:
        problem = "vLLM is not installed (pip install vllm, in a build matching this torch)"
    elif sharded:
        problem = "the weights are sharded (FSDP), and a colocated vLLM engine needs every rank to hold the whole model"
    if setting == "vllm":
        if problem:
            raise ConfigError(f"`method.rl.rollout: vllm` cannot run here: {problem}. Set `method.rl.rollout: auto` (vLLM where it can run, "
                              "else the model's own generate) or `generate`.")
        return "vllm", "method.rl.rollout: vllm"
    if problem:
        return "generate", f"auto: {problem}"
    return "vllm", "auto: vLLM is installed and the run is on CUDA"


def generate_rollout(sample, model, prompts: list[list[int]], seeds: list[int], G: int, pad_id: int) -> list[list[int]]:
    """`generate`: for each prompt, ``sample(model, ids, mask, do_sample=True, seed=s)`` on G copies of it (no padding,
    so a prompt's completions do not depend on which prompts share its batch). Completions in prompt-major order."""
    import torch

    device = next(model.parameters()).device
    out: list[list[int]] = []
    for p, s in zip(prompts, seeds):
        ids = torch.tensor([p] * G, dtype=torch.long, device=device)
        comp = sample(model, ids, torch.ones_like(ids), do_sample=True, seed=s)
        out.extend(row.tolist() for row in comp)
    return out


class VLLMRollout:
    """A vLLM engine colocated with training (see the module docstring): vLLM's ``LLM`` built from ``model_path`` and its
    ``SamplingParams``, or ``llm`` and ``sampling_params`` given (a stand-in in tests, where vLLM cannot run)."""

    def __init__(self, *, model_path: str, rl, stop_ids: list[int], seed: int, max_model_len: int, dtype: str = "auto",
                 trust_remote_code: bool = False, distributed: bool = False, llm=None, sampling_params=None):
        self.rl, self.stop_ids = rl, list(stop_ids)
        self.sampling_params = sampling_params
        if llm is None:
            from vllm import LLM, SamplingParams

            self.sampling_params = SamplingParams
            llm = LLM(model=model_path, dtype=dtype, enable_sleep_mode=True, gpu_memory_utilization=rl.vllm_gpu_memory_utilization,
                      max_model_len=max_model_len, seed=seed, trust_remote_code=trust_remote_code, max_num_batched_tokens=4096,
                      # under torchrun every rank's engine joins the process group the training made (TRL's colocate mode)
                      **({"distributed_executor_backend": "external_launcher"} if distributed else {}))
        self.llm = llm
        self.llm.sleep(level=2)  # the training owns the GPU until the first rollout
        self.synced_steps: list[int] = []

    def __call__(self, model, prompts: list[list[int]], seeds: list[int], G: int, step: int) -> list[list[int]]:
        self.sync(model, step)
        self.llm.wake_up(tags=["kv_cache"])
        try:
            params = [self._params(G, s) for s in seeds]
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params, use_tqdm=False)
            return [list(o.token_ids) for req in outs for o in req.outputs]
        finally:
            self.llm.sleep(level=2)

    def _params(self, G: int, seed: int):
        return self.sampling_params(n=G, seed=seed, temperature=self.rl.temperature, top_p=1.0, top_k=-1, max_tokens=self.rl.max_new_tokens,
                              stop_token_ids=self.stop_ids)

    def sync(self, model, step: int) -> None:
        """Wake the engine's weights and load the policy's current ones into it (PEFT: merged, then unmerged)."""
        self.llm.wake_up(tags=["weights"])
        target = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, tensor in vllm_weights(model):
            target.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()
        self.synced_steps.append(step)


def vllm_weights(model):
    """(name as vLLM's model names it, tensor) for every weight of the policy; a PEFT model's adapter is merged while
    they are read (TRL's colocate sync)."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        for name, p in model.named_parameters():
            if not name.startswith("v_head."):
                yield name, p.data
        return
    model.merge_adapter()
    try:
        prefix = model.prefix
        for name, p in model.named_parameters():
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if prefix in name or "original_module" in name or name.startswith("v_head."):
                continue
            yield name.replace("modules_to_save.default.", ""), p.data
    finally:
        model.unmerge_adapter()
