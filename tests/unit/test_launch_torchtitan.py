"""`trainpipe launch --emit torchtitan`: the hand-off script carries torchtitan's own config (its flavour and the overrides
the plan decides), and torchtitan 0.3's `ConfigManager` parses those arguments (installed without its dependencies by
`scripts/bootstrap.sh dev`: its config parser imports here, its trainer needs a GPU)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from trainpipe.cli import main

CONFIG = """name: {name}
model: {{name_or_path: {model}}}
data: {{sources: [{{path: train.jsonl}}], max_length: {length}}}
method: {{peft: {peft}}}
training: {{max_steps: 100, warmup_steps: 10, per_device_train_batch_size: auto, gradient_checkpointing: auto}}
distributed: {{nproc_per_node: 8, nnodes: {nodes}}}
"""


def _emit(tmp_path: Path, model: str, length: int, nodes: int, peft: str = "none") -> tuple[str, list[str]]:
    (tmp_path / "train.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(name="handoff", model=model, length=length, nodes=nodes, peft=peft))
    assert main(["launch", str(cfg), "--emit", "torchtitan", "-o", str(tmp_path / "out"), "--accelerator", "H100"]) == 0
    script = (tmp_path / "out" / "launch-torchtitan.sh").read_text()
    subprocess.run(["bash", "-n", str(tmp_path / "out" / "launch-torchtitan.sh")], check=True)  # valid bash
    line = next(x for x in script.splitlines() if x.startswith("torchrun "))
    argv = shlex.split(line.replace('"$HF"', "/hf").replace('"$DATA"', "/data").replace('"$OUT"', "/out").replace(' "$@"', ""))
    return script, argv[argv.index("torchtitan.train") + 1:]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _parse(args: list[str], base: str | None = None):
    """torchtitan's own parser on the emitted arguments (``base``: another flavour of the same Trainer.Config schema)."""
    cm = pytest.importorskip("torchtitan.config").ConfigManager
    if base is not None:
        args = [base if a == _flag(args, "--config") and i == args.index("--config") + 1 else a for i, a in enumerate(args)]
    return cm().parse_args(args)


def test_405b_full_on_16_nodes_hands_off_with_tp_pp_dp_from_the_plan(tmp_path):
    script, args = _emit(tmp_path, "meta-llama/Llama-3.1-405B", 8192, 16)
    assert _flag(args, "--module") == "llama3" and _flag(args, "--config") == "llama3_405b"
    tp, pp = int(_flag(args, "--parallelism.tensor_parallel_degree")), int(_flag(args, "--parallelism.pipeline_parallel_degree"))
    dp = int(_flag(args, "--parallelism.data_parallel_shard_degree"))
    assert tp == 8 and tp * pp * dp == 128 and "# fits: True" in script and "tensor+pipeline parallel" in script
    assert "--checkpoint.initial_load_in_hf" in args and "--checkpoint.last_save_in_hf" in args and "hf-final" in script
    # llama3_405b's config function builds float8 layers, which need an SM89 GPU: the same Trainer.Config schema is checked
    # through llama3_70b's function
    c = _parse(args, base="llama3_70b")
    assert (c.parallelism.tensor_parallel_degree, c.parallelism.pipeline_parallel_degree) == (tp, pp)
    assert c.training.steps == 100 and c.training.seq_len == 8192 and c.lr_scheduler.warmup_steps == 10
    assert c.checkpoint.initial_load_path == "/hf" and c.checkpoint.initial_load_in_hf and c.checkpoint.last_save_in_hf
    assert type(c.activation_checkpoint).__qualname__.startswith("FullAC")


def test_8b_at_64k_hands_the_sequence_degree_to_context_parallelism(tmp_path):
    _, args = _emit(tmp_path, "meta-llama/Llama-3.1-8B", 65536, 1, peft="lora")  # the plan's rule: sequence degree 2 (plan --model)
    c = _parse(args)
    assert c.parallelism.context_parallel_degree == 2 and c.parallelism.data_parallel_shard_degree == 4
    assert c.training.seq_len == 65536 and c.dataloader.dataset_path == "/data"


def test_a_model_torchtitan_has_no_flavour_for_is_one_paragraph(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text('{"text": "one"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(name="x", model="gpt2", length=512, nodes=1, peft="none"))
    assert main(["launch", str(cfg), "--emit", "torchtitan", "-o", str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr())
    assert "model.name_or_path" in err and "Llama" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
