"""Issue 14 item 8, noise: no command prints bitsandbytes' "No module named 'kernels'" line or transformers'
`is_gradient_checkpointing` FutureWarning, the filters are precise (other warnings still show), and `config show`
imports neither torch nor transformers for a config whose decisions do not need the model's size.

Each command runs in a fresh interpreter (subprocess), as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart" / "run.yaml"
KERNELS_LINE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _env() -> dict:
    # trainpipe, imported by this test process, set the progress-bar switches (its stderr is no terminal): not inherited
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_COLOR="1", COLUMNS="120")
    return env


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _python("import sys; from trainpipe.cli import main; sys.exit(main(sys.argv[1:]))", *args)


@pytest.mark.parametrize("args", [("--help",), ("config", "validate", str(QUICKSTART)), ("config", "show", str(QUICKSTART)), ("config", "schema")])
def test_config_commands_and_help_print_nothing_on_stderr(args):
    p = _cli(*args)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "", f"`trainpipe {' '.join(args)}` wrote to stderr:\n{p.stderr}"


# bitsandbytes logs the `kernels` line at import only on CPUs with AVX512-BF16. Where the CPU lacks it, a fake CPU
# feature (named as such: the one thing that cannot exist here) makes bitsandbytes' own import take that branch: its
# real code then tries the real `from kernels import get_kernel` and logs through its real logger.
_FORCE_AVX512_BF16 = """
import importlib.abc, sys
class FakeAvx512Bf16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "bitsandbytes.backends.cpu.ops":
            sys.modules["bitsandbytes.functional"].has_avx512bf16 = lambda: True
        return None
sys.meta_path.insert(0, FakeAvx512Bf16())
"""


# Without the `kernels` package bitsandbytes says "No module named 'kernels'"; with it (transformers 5.25+ installs it)
# and the Hub offline, kernels adds its trust-skip line and bitsandbytes says the kernel is not in the local cache.
# `kernels` missing is made real by a finder that raises what Python raises for a package that is not installed;
# `kernels` present runs only where it is installed.
_BLOCK_KERNELS = """
class NoKernelsPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "kernels":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoKernelsPackage())
"""
TRUST_LINE = "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"


def _kernels_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("kernels") is not None


@pytest.mark.parametrize("kernels", ["missing", "installed"])
@pytest.mark.parametrize("with_trainpipe", [False, True])
def test_bitsandbytes_kernels_line_is_gone_once_trainpipe_is_imported(with_trainpipe, kernels):
    pytest.importorskip("bitsandbytes")
    if kernels == "installed" and not _kernels_installed():
        pytest.skip("the `kernels` package is not installed here (transformers < 5.25 does not bring it)")
    code = (_FORCE_AVX512_BF16 + (_BLOCK_KERNELS if kernels == "missing" else "")
            + ("import trainpipe\n" if with_trainpipe else "") + "import bitsandbytes\nprint('ok')")
    p = _python(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    if with_trainpipe:
        assert KERNELS_LINE not in p.stderr and TRUST_LINE not in p.stderr, p.stderr
        assert p.stderr.strip() == "", p.stderr
    elif kernels == "missing":  # the lines this fixes are real: bitsandbytes prints them without trainpipe's filter
        assert KERNELS_LINE in p.stderr and "No module named 'kernels'" in p.stderr, p.stderr
    else:
        assert KERNELS_LINE in p.stderr and "offline mode" in p.stderr and TRUST_LINE in p.stderr, p.stderr


def test_the_filters_are_precise():
    """Another failure to load the kernel, another bitsandbytes warning, another FutureWarning of transformers and
    the same deprecation text from elsewhere all still show."""
    code = """
import logging, warnings
import trainpipe
log = logging.getLogger("bitsandbytes.backends.cpu.ops")
log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", ModuleNotFoundError("No module named 'kernels'", name="kernels"))
log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", RuntimeError("hub unreachable"))
log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", ValueError("Version 1 of 'x' is not available in the local cache and Hugging Face Hub is in offline mode."))
class ConnectError(Exception):  # the class name httpx uses: the Hub was not reached
    pass
try:
    try:
        raise ConnectError("[Errno -2] Name or service not known")
    except ConnectError as e:
        raise ValueError("Kernel repository 'x' could not verify publisher trust status.") from e
except ValueError as e:
    unreachable = e
log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", unreachable)
log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", ValueError("Kernel repository 'x' is not from a trusted publisher: refused"))
log.warning("another bitsandbytes warning")
klog = logging.getLogger("kernels._internals.hf_hub")
klog.warning("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face Hub is in offline mode.")
klog.warning("Skipping publisher trust check for 'someone/other-kernel' because Hugging Face Hub is in offline mode.")
warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
warnings.warn_explicit("`other_thing` is deprecated", FutureWarning, "modeling_utils.py", 2, module="transformers.modeling_utils")
warnings.warn_explicit("`is_gradient_checkpointing` is deprecated", FutureWarning, "mine.py", 3, module="mypackage.mine")
"""
    err = _python(code).stderr
    assert "No module named 'kernels'" not in err
    assert "hub unreachable" in err and "another bitsandbytes warning" in err and "refused" in err
    assert "offline mode." not in err.split("someone/other-kernel")[0] and "could not verify" not in err
    assert "'someone/other-kernel' because Hugging Face Hub is in offline mode." in err
    assert "`other_thing` is deprecated" in err and "mine.py:3" in err
    assert "modeling_utils.py:1" not in err


def test_config_show_imports_neither_torch_nor_transformers():
    code = (
        "import json, sys; from trainpipe.cli import main; rc = main(['config', 'show', sys.argv[1]]);"
        "print(json.dumps({'rc': rc, 'heavy': sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'peft', 'datasets'))}))"
    )
    p = _python(code, str(QUICKSTART))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0 and "training.save_steps: 40" in p.stdout
    assert out["heavy"] == [], f"`config show` imported {out['heavy'][:5]}"


def test_config_show_still_sizes_the_model_when_a_decision_needs_it(tmp_path):
    """`method.peft: auto` needs the model's size: config show then builds it (and says what it chose, as before)."""
    p = _cli("config", "show", str(QUICKSTART), "--set", "method.peft=auto")
    assert p.returncode == 0, p.stderr
    assert "# method.peft: none (CPU: full fine-tune below 1B parameters (3.3M)" in p.stdout
    assert p.stderr == ""


def test_config_shows_hardware_probe_reads_nvidia_smi_like_cuda(tmp_path, monkeypatch):
    """`detect_without_torch` on a GPU machine: a fake `nvidia-smi` and a CUDA build's version string stand in for the
    GPU that cannot exist here (named as such); CUDA_VISIBLE_DEVICES filters as CUDA does, bf16 from compute capability."""
    from importlib import metadata

    from trainpipe.plan.hardware import detect_without_torch

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA A100-SXM4-80GB, 8.0\\nNVIDIA A100-SXM4-80GB, 8.0\\nTesla V100-SXM2-16GB, 7.0\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0" if name == "torch" else real_version(name))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hw = detect_without_torch()
    assert (hw.accelerator, hw.device_count, hw.bf16_supported) == ("cuda", 3, False)  # the V100 has no bf16
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    hw = detect_without_torch()
    assert (hw.accelerator, hw.device_count, hw.device_names, hw.bf16_supported) == ("cuda", 2, ("NVIDIA A100-SXM4-80GB",) * 2, True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7,0")  # CUDA stops at the first index it cannot use
    assert detect_without_torch().device_names == ("Tesla V100-SXM2-16GB",)
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert detect_without_torch().accelerator == "cpu"
    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0+cpu" if name == "torch" else real_version(name))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert detect_without_torch().accelerator == "cpu"  # a CPU-only torch build cannot use the GPUs nvidia-smi sees


DEEPSPEED_LINE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."


@pytest.mark.parametrize("with_trainpipe", [False, True])
def test_deepspeeds_cpu_accelerator_line_is_gone_where_there_is_no_gpu(with_trainpipe):
    """DeepSpeed (imported by transformers' save_pretrained when installed, so at every export) prints this line on
    stdout, where `--json` output goes, on any machine without CUDA. This machine has none: real DeepSpeed, real torch."""
    pytest.importorskip("deepspeed")
    code = ("import trainpipe\n" if with_trainpipe else "") + "import deepspeed\nfrom deepspeed.accelerator import get_accelerator\nprint('ok', get_accelerator().device_name())"
    p = _python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "ok cpu"
    if with_trainpipe:
        assert DEEPSPEED_LINE not in p.stdout + p.stderr
    else:
        assert DEEPSPEED_LINE in p.stdout


def test_deepspeeds_cpu_accelerator_line_still_shows_where_a_gpu_went_undetected():
    """On a machine whose CUDA device DeepSpeed failed to detect, the line is real news. The GPU cannot exist here: a
    fake `torch.cuda.device_count` returning 1 (named as such) stands for it; the record goes through DeepSpeed's own
    logger, and another DeepSpeed warning always shows."""
    pytest.importorskip("deepspeed")
    code = f"""
import torch, trainpipe
from deepspeed.utils import logger
torch.cuda.device_count = lambda: 1  # fake: a GPU DeepSpeed did not detect
logger.warning({DEEPSPEED_LINE!r})
torch.cuda.device_count = lambda: 0
logger.warning({DEEPSPEED_LINE!r} + " (second)")
logger.warning("another DeepSpeed warning")
"""
    p = _python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(DEEPSPEED_LINE) == 1 and "(second)" not in p.stdout and "another DeepSpeed warning" in p.stdout


# ------------------------------------------------------------------------------ issue 24: noise a user reads as failure

_OPTUNA = """
import sys, warnings
if sys.argv[1] == "trainpipe":
    import trainpipe
import optuna
study = optuna.create_study(sampler=optuna.samplers.QMCSampler(seed=0, warn_independent_sampling=False))  # experimental in optuna
study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
optuna.logging.get_logger("optuna.study").warning("a real optuna warning")
optuna.logging.get_logger("optuna.study").error("a real optuna error")
warnings.warn("a warning of someone else", UserWarning)
"""


@pytest.mark.parametrize("with_trainpipe", [False, True])
def test_optunas_experimental_warning_and_info_chatter_are_gone_its_warnings_stay(with_trainpipe):
    """`trainpipe tune`/`automl` choose optuna's experimental samplers on purpose: its ExperimentalWarning and its INFO
    line per study and trial are noise once trainpipe is imported (by whichever module imports optuna); its own warnings
    and errors, and every other warning, still show. Without trainpipe, real optuna prints both (the test can fail)."""
    p = _python(_OPTUNA, "trainpipe" if with_trainpipe else "bare")
    assert p.returncode == 0, p.stderr
    assert "a real optuna warning" in p.stderr and "a real optuna error" in p.stderr and "a warning of someone else" in p.stderr
    noise = ("ExperimentalWarning" in p.stderr, "Trial 0 finished" in p.stderr, "A new study created" in p.stderr)
    assert noise == ((False,) * 3 if with_trainpipe else (True,) * 3), p.stderr


_HF_BARS = """
import sys
if sys.argv[1] == "trainpipe":
    import trainpipe
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from tiny import build_tiny_model
import datasets
from transformers import AutoModelForCausalLM
path = build_tiny_model(Path(sys.argv[3]) / "m")  # save_pretrained: "Writing model shards"
AutoModelForCausalLM.from_pretrained(path)  # "Loading weights"
datasets.Dataset.from_dict({"x": list(range(50))}).map(lambda r: r)  # "Map"
import logging; logging.getLogger("transformers").warning("a real transformers warning")
"""


@pytest.mark.parametrize("with_trainpipe", [False, True])
def test_hf_progress_bars_are_off_when_stderr_is_not_a_terminal(with_trainpipe, tmp_path):
    """Piped (a log file, CI), the tqdm bars of transformers, datasets and huggingface_hub are carriage-return walls;
    with trainpipe imported they are off, the libraries' warnings still show. Without it they print (the test can fail)."""
    p = _python(_HF_BARS, "trainpipe" if with_trainpipe else "bare", str(REPO / "tests"), str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "a real transformers warning" in p.stderr
    bars = [b for b in ("Writing model shards", "Loading weights", "Map") if f"{b}: 100%" in p.stderr or f"{b}:   0%" in p.stderr]
    assert bars == ([] if with_trainpipe else ["Writing model shards", "Loading weights", "Map"]), p.stderr[-2000:]


def test_a_users_own_progress_bar_setting_wins(tmp_path):
    env = {**_env(), "HF_HUB_DISABLE_PROGRESS_BARS": "0", "HF_DATASETS_DISABLE_PROGRESS_BARS": "0"}
    p = subprocess.run([sys.executable, "-c", _HF_BARS, "trainpipe", str(REPO / "tests"), str(tmp_path)], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Loading weights: 100%" in p.stderr and "Map: 100%" in p.stderr


_ALL_HELP = """
import contextlib, io, json, sys
from trainpipe.cli import app, main
import typer
cmd = typer.main.get_command(app)
paths = [[]]
for name, sub in cmd.commands.items():
    paths.append([name])
    for name2 in getattr(sub, "commands", {}):
        paths.append([name, name2])
out = {}
for path in paths:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main([*path, "--help"])
    out[" ".join(path)] = buf.getvalue()
print(json.dumps(out))
"""


def test_every_help_at_80_columns_cuts_no_word():
    """`--help` of every command at COLUMNS=80 (and when piped): a choice list (`auto|none|freeze|lora|dora|qlora`) or
    `--set training.learning_rate=1e-4` folds onto the next line instead of ending in "…"."""
    env = {**_env(), "COLUMNS": "80"}
    p = subprocess.run([sys.executable, "-c", _ALL_HELP], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    helps = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(helps) > 10 and "plan" in helps
    cut = {k: [ln for ln in v.splitlines() if "…" in ln] for k, v in helps.items()}
    assert not any(cut.values()), {k: v for k, v in cut.items() if v}
    assert all(max(len(ln) for ln in v.splitlines()) <= 80 for v in helps.values())
    flat = "".join(ch for ch in helps["plan"] if ch not in " │\n")
    assert "auto|none|freeze|lora|dora|qlora" in flat and "training.learning_rate=1e-4" in flat


_PLAN_JSON: dict = {}


def _plan_lines(*args, columns: int) -> tuple[str, dict]:
    env = {**_env(), "COLUMNS": str(columns)}
    text = subprocess.run([sys.executable, "-m", "trainpipe.cli", "plan", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert text.returncode == 0, text.stderr
    if args not in _PLAN_JSON:
        js = subprocess.run([sys.executable, "-m", "trainpipe.cli", "plan", *args, "--json"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert js.returncode == 0, js.stderr
        _PLAN_JSON[args] = json.loads(js.stdout)
    return text.stdout, _PLAN_JSON[args]


@pytest.mark.parametrize("columns", [80, 60])
@pytest.mark.parametrize("args", [(str(QUICKSTART),), ("--model", "meta-llama/Llama-3.1-8B", "--tokens", "1000000000", "--gpu", "H100-80GB", "--budget-usd", "1000")],
                         ids=["config", "ranking"])
def test_plan_tables_fit_the_console_and_cut_no_name_or_value(args, columns):
    """The plan at 80 columns (what a pipe gets) and at 60: no table line is wider, nothing ends in "…", and every choice's name,
    value, and every ranking figure, appears whole on a line (a table when it fits, else one entry a line)."""
    out, plan = _plan_lines(*args, columns=columns)
    lines = out.splitlines()
    assert "…" not in out
    # the tables and the one-entry-a-line layout fit; the prose lines are soft-wrapped (whole, for copying) as before
    assert max(len(ln) for ln in lines if set(ln) & set("┃│┏└") or ln.startswith("    ")) <= columns
    for d in plan["decision"]:
        assert any(d["key"] in ln and str(d["value"]) in ln for ln in lines), (d["key"], out)
    for row in plan.get("ranking") or ():
        figures = (f"{row['hours']:.2f}", f"{row['on_demand_usd']:,.2f}", f"{row['spot_usd']:,.2f}", f"{row['memory_margin_gib']:.1f}")
        assert any(all(f in ln for f in figures) for ln in lines), (figures, out)
        assert any(row["gpu"] in ln and row["strategy"] in ln for ln in lines), (row, out)
    assert bool(plan.get("ranking")) == ("--budget-usd" in args)
