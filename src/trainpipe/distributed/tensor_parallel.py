"""Tensor parallelism for Hugging Face models: transformers' own tensor-parallel plan (`tp_plan="auto"`).

transformers 5 ships a tensor-parallel plan for its dense decoder models (the `base_model_tp_plan` of each config:
q, k, v, gate and up projections split by output columns, o and down projections by input rows, the attention split by
heads) and applies it with torch's DTensor when a model is loaded with `tp_plan="auto"` on a device mesh; it runs on
gloo (CPU) as on NCCL. :func:`load` loads a model that way for a tensor group of ``degree`` ranks after
:func:`check` (the attention and key/value heads must divide, each rank keeping whole heads); a 2-process gloo test holds it to one process: the same loss and gradients on a tiny Llama.

Inside trainpipe's loop (`distributed.tensor_parallel: N`, the strategy in distributed/strategy.py) the model is built
whole on every rank and then split in place, as torchtitan does:

- :func:`styles`: the model's transformers plan (`base_model_tp_plan`: module patterns -> `colwise` / `rowwise`) as torch's
  ``ColwiseParallel`` / ``RowwiseParallel`` on the concrete ``nn.Linear`` modules it names; a model without a plan, a plan
  style torch has no equivalent for, or a pattern that lands on something other than a plain linear layer (an adapter)
  is one paragraph. Embeddings, norms and the output head stay whole on every rank of the tensor group (their gradients
  are the same there: every input they see is replicated).
- :func:`parallelize`: ``parallelize_module`` on the tensor dimension of the run's device mesh; it returns the hooks it
  added, so that :func:`release` can take them off again after training (every DTensor weight gathered whole, the
  model plain, as FSDP's release leaves it) for rank 0's final evaluation and export.
- :func:`clip_grad_norm`: the global gradient norm over weights that are DTensors (split on some mesh dimensions,
  replicated on others) and plain tensors (replicated on every rank), one all-reduce per group of like placements,
  then torch's clipping rule (coefficient ``max_norm / (norm + 1e-6)``, at most 1).
"""

from __future__ import annotations

from trainpipe.errors import TrainpipeError


def check(config, degree: int) -> None:
    """Whole heads on every rank: one paragraph naming the heads and the degrees that would divide them otherwise."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 0
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads and (heads % degree or kv % degree):
        ok = [d for d in range(1, heads + 1) if heads % d == 0 and kv % d == 0]
        raise TrainpipeError(
            f"A tensor-parallel degree of {degree} splits the attention by heads, and the model has {heads} attention and {kv} "
            f"key/value heads, which {degree} does not divide. Use a degree that divides both ({', '.join(map(str, ok))}).")


def load(path: str, degree: int, **kwargs):
    """The model at ``path`` split over a tensor group of ``degree`` ranks (every rank of the process group calls it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    check(AutoConfig.from_pretrained(path), degree)
    import torch

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (degree,))
    return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=mesh, **kwargs)


def styles(model, degree: int) -> dict:
    """{module path: torch parallel style} from the model's transformers tensor-parallel plan (see the module docstring)."""
    from fnmatch import fnmatchcase

    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    plan = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    name = type(model).__name__
    if not plan:
        raise TrainpipeError(
            f"`distributed.tensor_parallel: {degree}` splits the weights by the model's own tensor-parallel plan, and {name} "
            f"({getattr(cfg, 'model_type', '?')}) ships none in transformers (`base_model_tp_plan` is empty). Use a model family "
            "that has one (Llama, Mistral, Qwen2/3, Gemma, ...), or `distributed.tensor_parallel: 1` with `distributed.strategy: fsdp` "
            "(FSDP shards the same state without splitting the matrices).")
    check(model.config, degree)
    torch_style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    odd = sorted({v for v in plan.values() if v not in torch_style})
    if odd:
        raise TrainpipeError(
            f"`distributed.tensor_parallel: {degree}`: {name}'s tensor-parallel plan uses the style(s) {', '.join(odd)}, which trainpipe's "
            "loop does not map onto torch's parallel styles (it maps `colwise` and `rowwise`). Set `distributed.tensor_parallel: 1`, "
            "or hand the run to torchtitan with `trainpipe launch CONFIG --emit torchtitan -o DIR`.")
    # the decoder the plan's patterns are relative to: the module that is its own `base_model` (LlamaModel inside
    # LlamaForCausalLM, inside a PEFT wrapper too)
    prefix, base = next(((n + "." if n else "", m) for n, m in model.named_modules() if getattr(m, "base_model", None) is m), ("", model))
    out = {}
    for path, mod in base.named_modules():
        style = next((v for k, v in plan.items() if fnmatchcase(path, k)), None)
        if style is None:
            continue
        if type(mod) is not torch.nn.Linear:
            raise TrainpipeError(
                f"`distributed.tensor_parallel: {degree}` splits {prefix}{path} by columns or rows, and it is a {type(mod).__name__}, "
                "not a plain linear layer (an adapter wraps it). Tensor parallelism in trainpipe's loop trains full fine-tunes: set "
                "`method.peft: none`, or `distributed.tensor_parallel: 1` to train the adapter under FSDP or DDP.")
        out[prefix + path] = torch_style[style]()
    if not out:
        raise TrainpipeError(f"`distributed.tensor_parallel: {degree}`: {name}'s tensor-parallel plan ({', '.join(plan)}) names no "
                             "module of the model. Set `distributed.tensor_parallel: 1`.")
    return out


def parallelize(model, mesh, degree: int) -> list:
    """Split ``model`` in place over the 1-D tensor ``mesh`` (every rank of it calls this); returns the hooks added."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = styles(model, degree)
    mods = [model.get_submodule(p) for p in plan]
    before = [(set(m._forward_pre_hooks), set(m._forward_hooks)) for m in mods]
    parallelize_module(model, mesh, plan)
    return [(m, set(m._forward_pre_hooks) - pre, set(m._forward_hooks) - post) for m, (pre, post) in zip(mods, before)]


def gather_dtensors(model) -> None:
    """Every DTensor parameter of ``model`` replaced in place by a plain parameter holding the whole tensor (all ranks call
    this; tied parameters stay tied). FSDP2's release and this module's share it."""
    import torch
    from torch.distributed.tensor import DTensor

    full: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in full:
                    full[id(p)] = torch.nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
                mod._parameters[name] = full[id(p)]


def release(model, hooks: list) -> None:
    """Every DTensor weight gathered whole (all ranks call this) and the tensor-parallel hooks removed: a plain model."""
    gather_dtensors(model)
    for mod, pre, post in hooks:
        for k in pre:
            mod._forward_pre_hooks.pop(k, None)
        for k in post:
            mod._forward_hooks.pop(k, None)


def clip_grad_norm(params, max_norm: float) -> float:
    """The global L2 norm of the gradients of ``params`` (DTensors and plain tensors alike, see the module docstring),
    then every gradient scaled as ``torch.nn.utils.clip_grad_norm_`` does. Every rank calls it with its parameters in the
    same order; returns the norm before clipping."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list] = {}
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if isinstance(g, DTensor):
            split = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key, local = (g.device_mesh.mesh_dim_names, split), g.to_local()
        else:
            key, local = (None, ()), g
        entry = groups.setdefault(key, [g.device_mesh if isinstance(g, DTensor) else None, torch.zeros((), dtype=torch.float64, device=local.device)])
        entry[1] += local.detach().double().pow(2).sum()
    total = 0.0
    for key in sorted(groups, key=repr):  # the same order on every rank: the all-reduces pair up
        mesh, sq = groups[key]
        for dim in key[1]:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total += float(sq)
    norm = total ** 0.5
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for g in grads:
        g.mul_(coef)
    return norm


__all__ = ["check", "clip_grad_norm", "load", "parallelize", "release", "styles"]
