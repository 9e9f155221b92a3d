"""What the machine has: devices, their names and whether they do bfloat16.

No torch import at module load: ``detect()`` imports it when called.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Hardware:
    accelerator: str  # "cuda" | "mps" | "cpu"
    device_count: int
    device_names: tuple[str, ...] = field(default_factory=tuple)
    bf16_supported: bool = False
    cpu_count: int = 1
    platform: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["device_names"] = list(self.device_names)
        return d


def detect() -> Hardware:
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    plat = f"{platform.system()} {platform.machine()} python {platform.python_version()}"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = tuple(torch.cuda.get_device_name(i) for i in range(n))
        return Hardware("cuda", n, names, bool(torch.cuda.is_bf16_supported()), cpus, plat)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return Hardware("mps", 1, ("Apple MPS",), False, cpus, plat)
    return Hardware("cpu", 1, (platform.processor() or platform.machine(),), False, cpus, plat)


CPU = Hardware("cpu", 1, ("cpu",), False, 1, "")
