"""DeepSpeed ZeRO-2 / ZeRO-3 as a strategy of trainpipe's loop (`distributed.strategy: zero2 | zero3`).

The loop keeps its own window: each step's micro-batches, their exact denominator (the window's loss tokens, pairs or
prompts), the learning-rate schedule, the divergence guard, OOM recovery and checkpoints. DeepSpeed's engine
(``deepspeed.initialize``, with trainpipe's own optimizer object) partitions the optimizer state and gradients (ZeRO-2)
and the parameters too (ZeRO-3), and runs the optimizer step on each rank's partition:

- accumulation is the loop's: the engine runs with ``gradient_accumulation_steps: 1`` and
  ``managed_gradient_accumulation: false`` (DeepSpeed's caller-owned boundary: every backward reduces into the rank's
  gradient partition, :meth:`ZeroOptimizer.step` is the boundary). DeepSpeed then never divides a loss by its own
  accumulation count, so the loss the loop backpropagates (the window's sum / the window's weight, times the world
  size, as under DDP: ZeRO averages gradients over the ranks) gives exactly one process's gradient, also after an OOM
  halved the micro-batch or in a short last window, where a fixed DeepSpeed accumulation count would be wrong;
- the backward is torch's own (``loss.backward()`` on the engine forward's output; DeepSpeed's output hooks run its
  prologue and epilogue), so the stepper is the same for every strategy;
- the gradient norm is the global one over the partitions, taken before the step (the divergence guard reads it), and
  clipping is DeepSpeed's (``gradient_clipping`` = `training.max_grad_norm`, the same formula as torch's);
- a checkpoint is the full state gathered to rank 0 (``deepspeed.utils.safe_get_full_fp32_param`` and
  ``safe_get_full_optimizer_state``, every rank taking part) in one process's layout (optimizer state keyed by
  parameter index), written by trainpipe's CheckpointManager: atomic, with a checksum manifest, and the weights in
  safetensors (the gathered export other tools open). Loading sets every rank's partitions from the full state, so a
  checkpoint resumes under ZeRO, FSDP, DDP or one process alike.
"""

from __future__ import annotations

import warnings

from trainpipe.errors import TrainpipeError

OFFLOAD = {"none": {}, "optimizer": {"offload_optimizer": {"device": "cpu"}},
           "optimizer+params": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


def engine_config(stage: int, micro_batch: int, world: int, max_grad_norm: float, offload: str, bf16: bool = False, fp16: bool = False) -> dict:
    """The DeepSpeed config the loop's engine runs with (accumulation owned by the loop: see the module's docstring)."""
    if offload == "optimizer+params" and stage != 3:
        raise TrainpipeError("`distributed.offload: optimizer+params` needs ZeRO-3 (`distributed.strategy: zero3`): ZeRO-2 does not "
                             "partition parameters. Use `distributed.offload: optimizer` with `zero2`.")
    zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False, **OFFLOAD[offload]}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True})
    return {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "train_batch_size": micro_batch * world,
        "managed_gradient_accumulation": False, "gradient_clipping": float(max_grad_norm or 0.0), "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16)}, "fp16": {"enabled": bool(fp16)}, "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    }


class ZeroOptimizer:
    """What the loop and the stepper hold as their optimizer under DeepSpeed: the step is the engine's (partitioned, with
    DeepSpeed's clipping), the parameter groups are trainpipe's optimizer's (the scheduler sets their learning rates, which
    DeepSpeed's partitioned step reads)."""

    def __init__(self, engine, base, stage: int):
        self.engine, self.base, self.stage = engine, base, stage
        self._finalized = False  # the window's gradients are already finalized (the norm was taken): the step must not redo it
        self._stepped = False  # the last call was a step: the next zero_grad has nothing reduced to drop

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def state(self):
        return self.base.state

    def step(self) -> None:
        opt = self.engine.optimizer
        if self._finalized:  # finalize is not idempotent (ZeRO-2 releases the accumulation buffers it reads; offload copies)
            opt.finalize_gradient_accumulation_boundary = lambda: None  # this step only (an instance attribute over the method)
        try:
            self.engine.step()
        finally:
            opt.__dict__.pop("finalize_gradient_accumulation_boundary", None)
            self._finalized, self._stepped = False, True

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients the loop's window left in the partitions (every rank calls it), before the
        step: the divergence guard reads it, as it reads one process's clipped norm."""
        opt = self.engine.optimizer
        opt.finalize_gradient_accumulation_boundary()  # the reduced gradients as the step reads them (or their offloaded copy)
        self._finalized = True
        if self.stage == 3:
            from deepspeed.runtime.zero.stage3 import combine_grad_norm_groups

            return float(combine_grad_norm_groups(opt._get_norm_groups()))
        return float(opt.scaled_global_norm())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the window's gradients: after a step (which already emptied the partitions), or when a window is retried
        after an OOM or dropped after a divergent step, whose gradients already reduced into the partitions must go too
        (what DeepSpeed does with an overflowed fp16 step), so that the retried window accumulates from nothing."""
        opt = self.engine.optimizer
        opt.zero_grad(set_to_none=set_to_none)
        if self._stepped:
            self._stepped = False
            return
        self._finalized = False
        if self.stage == 2:
            opt._release_preflattened_grad_buffers()
            if opt.cpu_offload:
                opt.reset_cpu_buffers()
                opt._offload_accumulated_param_ids = set()
            else:
                for k in list(opt.averaged_gradients.keys()):
                    opt.averaged_gradients[k] = None
                    opt.all_grad_tensors[k] = None
            opt.micro_step_id = -1  # the next backward starts a new accumulation
        else:
            opt.micro_step_id = 0  # ZeRO-3: the next backward copies into the gradient partitions instead of adding

    def state_dict(self):
        raise TrainpipeError("Under DeepSpeed the optimizer state is gathered by the strategy (Strategy.checkpoint), not read per rank.")


def initialize(model, optimizer, config: dict):
    """``deepspeed.initialize`` on the model with trainpipe's optimizer; returns (engine, ZeroOptimizer, names by group)."""
    import deepspeed
    import deepspeed.ops
    import torch

    if not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce op (g++ and ninja, minutes, under a file
        # lock every worker waits on) before the first step; gloo's collectives do the same reductions
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed calls torch's old collective names; torch warns on each call (a FutureWarning per step on the console)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]  # one process's optimizer layout
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine, ZeroOptimizer(engine, optimizer, config["zero_optimization"]["stage"]), groups


def full_state(model, groups: list[list[str]], base, engine_optimizer) -> tuple[dict, dict]:
    """(trainable weights, optimizer state) gathered from every rank's partitions, in one process's layout (the optimizer
    state keyed by parameter index, groups in order). Every rank calls it; every rank gets the full state (rank 0 writes)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = dict(model.named_parameters())
    _link_optimizer_state(engine_optimizer)
    weights = {n: safe_get_full_fp32_param(params[n]).detach().cpu().clone() for g in groups for n in g}
    flat_state = next((s for s in base.state.values() if s), {})
    keys = [k for k, v in flat_state.items() if hasattr(v, "dim") and v.dim() > 0]
    scalars = {k: v.detach().cpu().clone() if hasattr(v, "detach") else v for k, v in flat_state.items() if k not in keys}
    state, pgroups, i = {}, [], 0
    for gi, g in enumerate(groups):
        pg = {k: v for k, v in base.param_groups[gi].items() if k != "params"}
        pg["params"] = list(range(i, i + len(g)))
        pgroups.append(pg)
        for n in g:
            if flat_state:
                state[i] = {**{k: v.clone() if hasattr(v, "clone") else v for k, v in scalars.items()},
                            **{k: safe_get_full_optimizer_state(params[n], k).detach().cpu().clone() for k in keys}}
            i += 1
    return weights, {"state": state, "param_groups": pgroups}


def _link_optimizer_state(opt) -> None:
    """ZeRO-2 links each parameter to its fragment of the optimizer state once, after its first step; link it again (the
    state a load created, or the first step's) so that DeepSpeed's full-state getters and setters find it."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    if hasattr(opt, "bit16_groups") and opt.optimizer.state:
        for i, _ in enumerate(opt.optimizer.param_groups):
            lazy_init_hp_params_optimizer_state(opt.bit16_groups[i], opt.single_partition_of_fp32_groups[i], opt.optimizer.state)


def _set_full(param, value, key: str | None = None) -> None:
    """DeepSpeed's `safe_set_full_fp32_param` / `safe_set_full_optimizer_state`, except that under ZeRO-3 a parameter
    whose size the world size does not divide (a 3-class head's bias on 2 ranks: partitions of 2, the last one padded)
    is set from the value padded to the partitions' whole size: DeepSpeed 0.19 narrows the unpadded value and fails on
    the last rank ("start (2) + length (2) exceeds dimension size (3)")."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if not hasattr(param, "ds_id"):
        safe_set_full_fp32_param(param, value) if key is None else safe_set_full_optimizer_state(param, value, key)
        return
    if not param.requires_grad:
        return
    opt = param._z3_optimizer
    part, group = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    n, rank = part.numel(), opt._get_param_partition_rank(param)
    flat = value.flatten()
    if flat.numel() < n * (rank + 1):
        flat = torch.cat([flat, flat.new_zeros(n * (rank + 1) - flat.numel())])
    part.data.copy_(flat.narrow(0, n * rank, n).data)
    if opt._swappable_optimizer_subgroup(group):
        opt._optimizer_states_and_gradient_swap_out(group)


def load_full_state(model, groups: list[list[str]], base, engine_optimizer, weights: dict, optim_sd: dict | None, stage: int) -> None:
    """Set every rank's partitions (weights, master weights, optimizer state) from a full checkpoint (every rank passes the
    same full state)."""
    import torch

    params = dict(model.named_parameters())
    for g in groups:
        for n in g:
            p = params[n]
            _set_full(p, weights[n].to(torch.float32))
            if stage == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if torch.distributed.get_rank() == 0:
                        p.data.copy_(weights[n].to(p.dtype))
            else:
                p.data.copy_(weights[n].to(p.dtype))
    if not optim_sd or not optim_sd.get("state"):
        return
    first = next(iter(optim_sd["state"].values()))
    flats = getattr(engine_optimizer, "fp32_partitioned_groups_flat", None) or engine_optimizer.single_partition_of_fp32_groups
    for flat in flats:  # every partition's state (ZeRO-3: per sub-group), created as its first step would, then filled below
        st = base.state[flat]
        for k, v in first.items():
            if hasattr(v, "dim") and v.dim() > 0:
                st.setdefault(k, torch.zeros_like(flat))
            else:
                st[k] = v.clone() if hasattr(v, "clone") else v
    _link_optimizer_state(engine_optimizer)
    order = [n for g in groups for n in g]
    for i, n in enumerate(order):
        for k, v in optim_sd["state"][i].items():
            if hasattr(v, "dim") and v.dim() > 0:
                _set_full(params[n], v.to(torch.float32), k)
    for pg, saved in zip(base.param_groups, optim_sd["param_groups"], strict=False):
        for k, v in saved.items():
            if k not in ("params", "lr"):
                pg[k] = v


def release(engine, model, stage: int) -> None:
    """After training: every parameter whole and plain on every rank, DeepSpeed's hooks removed (all ranks call it), so
    that rank 0 evaluates and exports a plain model."""
    params = list(model.parameters())
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            full = [p.data.detach().clone() for p in params]
    else:
        full = [p.data.detach().clone() for p in params]  # views into ZeRO's flat buffer: each its own storage
    engine.destroy()
    for p, data in zip(params, full, strict=True):
        p.data = data
        for attr in [a for a in vars(p) if a.startswith("ds_")]:
            delattr(p, attr)
        p.grad = None


def hook_state(strategy) -> None:
    """ZeRO has no DDP communication hook: `distributed.grad_compression` other than none is refused."""
    if strategy.dist.grad_compression != "none":
        raise TrainpipeError(
            f"`distributed.grad_compression: {strategy.dist.grad_compression}` is a DDP communication hook; DeepSpeed ZeRO reduces "
            f"its own gradient partitions and has none. Set `distributed.grad_compression: none` with `distributed.strategy: "
            f"{strategy.name}`, or use `ddp`."
        )


__all__ = ["OFFLOAD", "ZeroOptimizer", "engine_config", "full_state", "hook_state", "initialize", "load_full_state", "release"]
