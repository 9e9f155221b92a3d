"""FSDP2 (``torch.distributed.fsdp.fully_shard``) around the model of a distributed run (`distributed.strategy: fsdp`).

- :func:`wrap`: ``fully_shard`` on each decoder layer (the classes the model names in ``_no_split_modules``), then on
  the root, in place: parameters become DTensors sharded on dim 0 across the ranks, fp32 (no mixed-precision policy:
  the loop's autocast does that on GPUs). LoRA mixes frozen and trainable parameters in one layer; FSDP2 shards them
  per parameter and reduce-scatters only the gradients that exist. The optimizer is built afterwards, on the shards.
- :func:`four_bit_storage_as_float`: QLoRA under FSDP (PEFT's `bnb_4bit_quant_storage` recipe): the packed 4-bit bytes
  of bitsandbytes' weights viewed as the float dtype, so that FSDP2 shards and all-gathers them with the rest.
- :func:`no_sync`: accumulation micro-steps keep their gradients unsharded and local
  (``set_requires_gradient_sync(False)``); the window's last micro-step reduce-scatters the sum (FSDP2 averages over
  the ranks, like DDP, so the loop scales the loss by the world size in both).
- :func:`full_state` / :func:`load_full_state`: a checkpoint is the gathered full state (every rank takes part, rank 0
  receives it on the CPU and writes it through the CheckpointManager: atomic, with checksums), in the same layout as
  one process's checkpoint (the optimizer state keyed by parameter index), so a checkpoint resumes under one process,
  DDP or FSDP alike. Loading gives every rank the full state and keeps its shard.
- :func:`release`: after training, gather every parameter and take FSDP off the model in place, so that rank 0
  evaluates, generates and exports a plain model (a sharded model's forward needs every rank).
"""

from __future__ import annotations

from contextlib import contextmanager

from trainpipe.distributed.tensor_parallel import gather_dtensors
from trainpipe.errors import TrainpipeError


def decoder_layers(model) -> list:
    """The model's repeated blocks: modules whose class the model lists in ``_no_split_modules`` (transformers' own
    "do not split this" set: the decoder layers), found inside a PEFT wrapper too."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise TrainpipeError(
            f"`distributed.strategy: fsdp` shards the model layer by layer, and {type(model).__name__} names no decoder layer "
            "class (`_no_split_modules`). Use `distributed.strategy: ddp`."
        )
    return layers


def wrap(model, grad_compression: str = "none", offload: str = "none", mesh=None):
    """``fully_shard`` each decoder layer, then the root (in place; returns the model). ``offload`` other than `none`:
    FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and the optimizer step live in host memory; FSDP2 has
    no optimizer-only offload, so `optimizer` offloads the parameters too). ``mesh``: the data-parallel dimension of a 2-D
    mesh (tensor parallelism, distributed/strategy.py `TensorParallel`); None: every rank."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if grad_compression != "none":
        raise TrainpipeError(
            f"`distributed.grad_compression: {grad_compression}` is a DDP communication hook; FSDP reduce-scatters its own "
            "gradients and has none. Set `distributed.grad_compression: none` with `distributed.strategy: fsdp`, or use `ddp`."
        )
    four_bit_storage_as_float(model)
    for p in model.parameters():
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TrainpipeError(
                f"`distributed.strategy: fsdp` trains on floating-point weights, and this model holds {p.dtype} parameters "
                "(an 8-bit quantized model: `qlora8`). Under FSDP trainpipe trains `method.peft: none | freeze | lora | rslora | "
                "dora | qlora`; for 8-bit QLoRA on several processes use `distributed.strategy: ddp`."
            )
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload != "none" else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    if hasattr(model, "generate"):  # sampling (rl) calls generate, not forward: it must gather the root's weights too
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    return model


def four_bit_storage_as_float(model) -> int:
    """QLoRA under FSDP, PEFT's recipe (`bnb_4bit_quant_storage` = the float dtype of the other parameters): the packed
    4-bit bytes of every bitsandbytes ``Params4bit`` are viewed as that float dtype (4 bytes = 8 weights per float32), so
    that FSDP2 shards them on dim 0 like any other parameter and all-gathers them, in one flat buffer of one dtype,
    before each layer's forward. The bytes and the quantization state are unchanged; bitsandbytes' ``Linear4bit``
    re-attaches its module's ``quant_state`` to the gathered tensor in its forward (``fix_4bit_weight_quant_state_from_module``,
    written for FSDP). Returns the number of weights converted."""
    import torch

    four = [(m, m.weight) for m in model.modules() if type(getattr(m, "weight", None)).__name__ == "Params4bit"]
    if not four:
        return 0
    import bitsandbytes as bnb

    floats = {p.dtype for p in model.parameters() if p.dtype.is_floating_point and type(p).__name__ != "Params4bit"}
    target = torch.float32 if torch.float32 in floats or not floats else next(iter(floats))
    for mod, w in four:
        if w.dtype == target:
            mod.quant_state, mod.quant_storage = w.quant_state, target
            continue
        data = w.data.reshape(-1)
        if w.dtype != torch.uint8 or (data.numel() * data.element_size()) % target.itemsize:
            raise TrainpipeError(
                f"`distributed.strategy: fsdp` with `method.peft: qlora` shards the 4-bit weights as {target}, and a weight of "
                f"{type(mod).__name__} holds {data.numel()} {w.dtype} values that do not fill whole {target} elements. Use "
                "`distributed.strategy: ddp` with `qlora`, or `fsdp` with `lora`."
            )
        new = bnb.nn.Params4bit(
            data.view(torch.uint8).view(target).reshape(-1, 1), requires_grad=False, quant_state=w.quant_state, blocksize=w.blocksize,
            compress_statistics=w.compress_statistics, quant_type=w.quant_type, quant_storage=target, module=mod, bnb_quantized=True,
        )
        mod._parameters["weight"] = new
        mod.quant_state, mod.quant_storage = w.quant_state, target
    return len(four)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def scalar(x) -> float:
    """A float of a (possibly DTensor) scalar: the global value (the gradient norm of sharded gradients)."""
    from torch.distributed.tensor import DTensor

    return float(x.full_tensor() if isinstance(x, DTensor) else x)


def _index(optimizer, model) -> dict[str, int]:
    """Parameter name -> the index one process's ``optimizer.state_dict()`` gives it (groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {n: i for i, n in enumerate(order)}


def full_state(model, optimizer) -> tuple[dict, dict]:
    """(trainable weights, optimizer state) gathered to rank 0 on the CPU (empty dicts on the other ranks). Every rank
    must call it. The optimizer state is keyed like one process's ``optimizer.state_dict()``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=opts)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = {n: t for n, t in weights.items() if n in trainable}  # one process's checkpoint holds these (no buffers)
    if not optimizer.state:
        # before the first step: torch's getter would initialise the state with a zero-gradient step (Adam's step
        # count then runs one ahead of one process's); an empty state is the same on every rank, as it is
        return (weights if dist.get_rank() == 0 else {}), (optimizer.state_dict() if dist.get_rank() == 0 else {})
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if dist.get_rank() != 0:
        return {}, {}
    idx = _index(optimizer, model)
    osd = {
        "state": {idx[n]: v for n, v in osd["state"].items()},
        "param_groups": [{**g, "params": [idx[n] for n in g["params"]]} for g in osd["param_groups"]],
    }
    return weights, osd


def load_full_state(model, optimizer, weights: dict, optim_sd: dict | None) -> None:
    """Load a full checkpoint (every rank passes the same full state; each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=opts)
    if optim_sd is not None and not optim_sd["state"]:  # a checkpoint before the first step: nothing is sharded yet
        optimizer.load_state_dict(optim_sd)
    elif optim_sd is not None:
        name = {i: n for n, i in _index(optimizer, model).items()}
        osd = {
            "state": {name[int(i)]: v for i, v in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [name[int(i)] for i in g["params"]]} for g in optim_sd["param_groups"]],
        }
        set_optimizer_state_dict(model, optimizer, osd, options=opts)


def release(model) -> None:
    """Gather every parameter (all ranks) and take FSDP off the model in place: plain parameters, no hooks, the
    original classes. Tied parameters stay tied."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.reshard()
    gather_dtensors(model)
    for m in mods:
        state = m._get_fsdp_state()
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        group = state._fsdp_param_group
        if group is not None:
            for h in [*group._module_to_pre_save_state_dict_hook_handle.values(), *group._module_to_pre_load_state_dict_hook_handle.values()]:
                h.remove()
            for fp in group.fsdp_params:  # each sharded parameter re-shards itself after a load_state_dict
                fp._post_load_hook_handle.remove()
        cls = type(m)
        m.__class__ = cls.__mro__[cls._orig_cls_mro_index]
        m.__dict__.pop("generate", None)  # register_fsdp_forward_method's wrapper (wrap) is an instance attribute
        m.__dict__.pop(STATE_KEY, None)
        m.__dict__.pop(REGISTRY_KEY, None)
    for mod in model.modules():
        mod.__dict__.pop("_is_fsdp_managed_module", None)
        mod.__dict__.pop("_fsdp_use_orig_params", None)
