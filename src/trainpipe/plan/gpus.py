"""The GPU catalog (`plan/data/gpus.json`, or a user file of the same form) and GPU-name normalisation."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from trainpipe.errors import TrainpipeError

GIB = 1024**3


class UnknownGPUError(TrainpipeError):
    title = "unknown GPU"


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16: bool
    bf16_tflops: float
    fp16_tflops: float
    interconnect: str
    max_per_node: int
    on_demand_usd: float
    spot_usd: float
    arch: str = ""
    source: str = ""
    price_source: str = ""
    date: str = ""
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def peak_tflops(self, precision: str) -> float:
        """Dense tensor-core peak for this precision. fp32 training is counted at half the 16-bit rate on
        bf16-capable GPUs (TF32 tensor cores) and an eighth of the fp16 rate before them (no TF32)."""
        if precision in ("bf16", "bf16-true"):
            return self.bf16_tflops or self.fp16_tflops
        if precision == "fp16":
            return self.fp16_tflops
        return (self.bf16_tflops / 2) if self.bf16 else self.fp16_tflops / 8


@lru_cache(maxsize=4096)
def normalise(name: str) -> str:
    """`A100-80GB`, `a100 80gb`, `NVIDIA A100-SXM4-80GB` -> one key (case, spaces, hyphens, vendor words ignored)."""
    s = name.lower()
    s = re.sub(r"\b(nvidia|geforce|tesla|amd|instinct)\b", "", s)
    return re.sub(r"[\s_\-]+", "", s)


def _load(text: str, where: str) -> list[GPU]:
    try:
        rows = json.loads(text)["gpus"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UnknownGPUError(f"GPU file `{where}` must be JSON with a `gpus` list like plan/data/gpus.json ({exc}).") from None
    out = []
    fields = set(GPU.__dataclass_fields__)
    for r in rows:
        missing = {"name", "memory_gib", "bf16", "bf16_tflops", "fp16_tflops", "on_demand_usd", "spot_usd"} - set(r)
        if missing:
            raise UnknownGPUError(f"GPU file `{where}`: row `{r.get('name', '?')}` lacks {', '.join(sorted(missing))}; every row needs memory, bf16, TFLOP/s and prices.")
        kw = {"interconnect": "", "max_per_node": 8, **{k: v for k, v in r.items() if k in fields}}
        kw["aliases"] = tuple(kw.get("aliases", ()))
        out.append(GPU(**kw))
    return out


@lru_cache(maxsize=1)
def builtin() -> tuple[GPU, ...]:
    return tuple(_load(resources.files("trainpipe.plan").joinpath("data", "gpus.json").read_text(encoding="utf-8"), "plan/data/gpus.json"))


def catalog(user_file: str | Path | None = None) -> list[GPU]:
    """Built-in GPUs, with rows of `user_file` replacing same-named ones and adding new ones."""
    gpus = {normalise(g.name): g for g in builtin()}
    if user_file:
        p = Path(user_file)
        if not p.is_file():
            raise UnknownGPUError(f"GPU file `{p}` does not exist; pass a JSON file in the format of plan/data/gpus.json.")
        for g in _load(p.read_text(encoding="utf-8"), str(p)):
            gpus[normalise(g.name)] = g
    return list(gpus.values())


def find_gpu(name: str, user_file: str | Path | None = None) -> GPU:
    gpus = catalog(user_file)
    keys: dict[str, GPU] = {}
    for g in gpus:
        keys[normalise(g.name)] = g
        for a in g.aliases:
            keys.setdefault(normalise(a), g)
    k = normalise(name)
    if k in keys:
        return keys[k]
    close = difflib.get_close_matches(k, list(keys), n=4, cutoff=0.4)
    names = []
    for c in close:
        if keys[c].name not in names:
            names.append(keys[c].name)
    hint = f" Close: {', '.join(names)}." if names else ""
    raise UnknownGPUError(
        f"GPU `{name}` is not in the GPU catalog.{hint} Known: {', '.join(g.name for g in gpus)} (case and hyphens are ignored). "
        "Add your own with `--gpu-file FILE` (rows as in plan/data/gpus.json)."
    )


def gpu_from_device_name(name: str) -> str | None:
    """The catalog name of a CUDA device name (`NVIDIA A100-SXM4-80GB` -> `A100-80GB`), or None when it is not in the catalog."""
    n = name.upper().replace("NVIDIA", "").strip()
    for cand in (n, n.replace(" ", "-"), n.split()[0] if n.split() else n):
        try:
            return find_gpu(cand).name
        except UnknownGPUError:
            continue
    return None
