"""The vision environment for tests that need torchvision (timm; the Qwen2-VL and SmolVLM processors): PyPI's torchvision
does not import beside the main environment's torch 2.13.0 CPU build, so these tests run trainpipe in the environment
scripts/vision_venv.sh makes (torch 2.14.1 + torchvision 0.29.1 + timm, pinned by scripts/constraints-vision.txt;
~/.cache/trainpipe/vision-venv or $TRAINPIPE_VISION_VENV), as a subprocess with this clone's `src` (and `tests`) on
PYTHONPATH. `.ci/run` makes it beside the main environment; elsewhere the fixture makes it on first use (5-16 minutes on the shared
2-core machine, the wheels on its disk; 7.6 s to reuse), and skips with the reason when it cannot (no network, no disk,
another platform). TRAINPIPE_VISION_VENV=off skips these tests without trying.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def vision_python() -> str:
    """The vision environment's interpreter (made by scripts/vision_venv.sh when missing or out of date)."""
    if os.environ.get("TRAINPIPE_VISION_VENV", "").lower() == "off":
        pytest.skip("TRAINPIPE_VISION_VENV=off: the torchvision environment (scripts/vision_venv.sh) is turned off")
    try:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "vision_venv.sh")], capture_output=True, text=True, timeout=2400)
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/vision_venv.sh did not finish in 40 minutes (the torch 2.14.1 + torchvision download)")
    if proc.returncode != 0:
        tail = " | ".join(line for line in proc.stderr.splitlines()[-6:] if "is ignored" not in line)
        pytest.skip(f"scripts/vision_venv.sh could not make the torchvision environment (exit {proc.returncode}): {tail[-800:]}")
    return proc.stdout.strip().splitlines()[-1]


def vision_env(**extra: str) -> dict:
    """The environment of a subprocess in the vision venv: this clone's sources first on the path, offline, no colour."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "TRAINPIPE_TEST_FAULTS")}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1",
                "COLUMNS": "200", "TRAINPIPE_TRACKING": "none", **extra})
    return env


def run_vision(python: str, args: list[str], *, timeout: int = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` in the vision venv (``args`` after the interpreter: `-m trainpipe.cli ...` or `-c CODE`), output captured."""
    return subprocess.run([python, *args], env=vision_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def trainpipe(python: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m trainpipe.cli ARGS` in the vision venv; fails the test with the output's end when it exits non-zero."""
    proc = run_vision(python, ["-m", "trainpipe.cli", *args], timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc
