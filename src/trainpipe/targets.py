"""Every launch and compile target trainpipe writes, listed once.

`trainpipe launch --emit NAME` (launch_files.py) and `trainpipe pipeline compile --target NAME` (pipeline/compile.py)
read their choices, file names, descriptions and help text from these two tables; the CLI's help and the refusal of an
unknown name are built from them. A new target is one row here plus the function that writes it.
"""

from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    file: str  # the file written (in the `-o` folder for a launch file; the default `-o` of a compile)
    what: str  # what it is, in the ownership rule's messages
    help: str  # one phrase for `--help`


# `trainpipe launch CONFIG --emit NAME -o DIR`
LAUNCH_TARGETS: dict[str, Target] = {
    "torchrun": Target("launch-torchrun.sh", "the torchrun launch script", "a torchrun script run on every node"),
    "slurm": Target("launch.sbatch", "the sbatch script", "an sbatch script (requeued on preemption)"),
    "k8s": Target("trainjob.yaml", "the Kubeflow TrainJob, its ConfigMap and volume claim", "a Kubeflow TrainJob, its ConfigMap and volume claim"),
    "skypilot": Target("skypilot.yaml", "the SkyPilot task", "a SkyPilot task on spot nodes"),
    "deepspeed": Target("launch-deepspeed.sh", "the deepspeed launch script", "a deepspeed launcher script (ZeRO)"),
    "torchtitan": Target("launch-torchtitan.sh", "the torchtitan launch script", "a torchtitan hand-off: its config from the plan, HF checkpoints in and out"),
}
# launch targets trainpipe names and refuses, each with its one paragraph (nothing is written)
REFUSED_LAUNCH_TARGETS: dict[str, str] = {
    "megatron-bridge": (
        "`--emit megatron-bridge` is refused: trainpipe writes a Megatron-Bridge config only where the engine's own parser can "
        "check it, and Megatron-Bridge does not import without CUDA. megatron-bridge 0.3.1 (PyPI) imports transformer-engine at "
        "`import megatron.bridge` (megatron/bridge/peft/lora_layers.py: `import transformer_engine.pytorch`), whose core library "
        "loads cuDNN and the CUDA runtime (on a CPU machine: `RuntimeError: cudnn shared object not found`), and it pins "
        "transformers < 5 (trainpipe runs transformers 5). Nothing was written. Use `--emit torchtitan` (the same TP x PP x DP / "
        "context-parallel plan, parsed by torchtitan's own ConfigManager), or write Megatron-Bridge's recipe by hand on a CUDA "
        "machine from the plan `trainpipe plan CONFIG --gpu ... --num-gpus ... --nodes ...` prints."),
}
# variants of a launch target chosen by a flag (`--pytorchjob`), not by `--emit`
LAUNCH_VARIANTS: dict[str, Target] = {
    "k8s-pytorchjob": Target("pytorchjob.yaml", "the Kubeflow PyTorchJob and its ConfigMap", "the older Kubeflow PyTorchJob"),
}

# `trainpipe pipeline compile CONFIG --target NAME -o FILE`
COMPILE_TARGETS: dict[str, Target] = {
    "kfp": Target("pipeline.yaml", "the Kubeflow Pipelines v2 pipeline", "Kubeflow Pipelines v2 (IR YAML)"),
    "airflow": Target("trainpipe_dag.py", "the Airflow DAG file", "an Airflow 3 DAG file (KubernetesPodOperator or local BashOperator tasks)"),
    "prefect": Target("trainpipe_flow.py", "the Prefect flow file", "a Prefect 3 flow file (one task per step) and its deployment"),
    "vertex": Target("vertex-pipeline.yaml", "the Vertex AI pipeline (KFP IR) and PipelineJob request", "Vertex AI Pipelines: KFP IR + PipelineJob request body"),
}


def names(table: dict[str, Target]) -> str:
    """`a, b, c`: the choices, in the table's order."""
    return ", ".join(table)


def help_text(table: dict[str, Target]) -> str:
    """`a (what) | b (what)`: the CLI option's help."""
    return " | ".join(f"{k} ({t.help})" for k, t in table.items())


def unknown(option: str, value: str, table: dict[str, Target]) -> str:
    """The one-paragraph refusal of a name the table lacks."""
    return f"`{option} {value}` is not a target trainpipe writes; `{option}` must be one of {names(table)}."
