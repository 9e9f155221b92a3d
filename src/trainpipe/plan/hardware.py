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
    compute_capability: float = 0.0  # the first CUDA device's (8.0 A100, 9.0 H100); 0.0: not a CUDA GPU, or not known

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
        major, minor = torch.cuda.get_device_capability(0)
        return Hardware("cuda", n, names, bool(torch.cuda.is_bf16_supported()), cpus, plat, float(f"{major}.{minor}"))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return Hardware("mps", 1, ("Apple MPS",), False, cpus, plat)
    return Hardware("cpu", 1, (platform.processor() or platform.machine(),), False, cpus, plat)


def detect_without_torch() -> Hardware:
    """What :func:`detect` would answer, without importing torch (for `trainpipe config show`, which must start fast):
    CUDA devices from `nvidia-smi` (name, compute capability >= 8.0 for bfloat16), filtered by CUDA_VISIBLE_DEVICES,
    when the installed torch is not a CPU-only build; Apple MPS on macOS arm64; else the CPU. `trainpipe run` and
    `trainpipe plan` keep asking torch itself (:func:`detect`)."""
    import subprocess
    import sys
    from importlib import metadata

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    plat = f"{platform.system()} {platform.machine()} python {platform.python_version()}"
    cpu = Hardware("cpu", 1, (platform.processor() or platform.machine(),), False, cpus, plat)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return cpu
    if sys.platform == "darwin":
        return Hardware("mps", 1, ("Apple MPS",), False, cpus, plat) if platform.machine() == "arm64" else cpu
    if "+cpu" in torch_version:
        return cpu
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return cpu
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # as CUDA reads it: indices or GPU-/MIG- ids, up to the first entry it cannot use
        keep = []
        for tok in (t.strip() for t in visible.split(",")):
            if tok.isdigit() and int(tok) < len(rows):
                keep.append(rows[int(tok)])
            elif tok.startswith(("GPU-", "MIG-")) and len(keep) < len(rows):
                keep.append(rows[len(keep)])  # an id: counted (which device it names does not change name or bf16 here)
            else:
                break
        rows = keep
    if not rows:
        return cpu
    names = tuple(r[0] for r in rows)

    def cap(r: list[str]) -> float:
        try:
            return float(r[1])
        except (IndexError, ValueError):
            return 0.0

    return Hardware("cuda", len(rows), names, all(cap(r) >= 8.0 for r in rows), cpus, plat, cap(rows[0]))


CPU = Hardware("cpu", 1, ("cpu",), False, 1, "")
