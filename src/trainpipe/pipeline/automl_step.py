"""`pipeline.automl: true`: AutoGluon's `trainpipe automl --task tabular` as a step of the DAG, beside the built-in chain.

The step is a function step of `pipeline.steps` (custom.py) that trainpipe writes itself: `tune/steps/automl_step.py`
`run_step`, named by its file path (this layer never imports the search layer). Its inputs are every `data.sources` path
(by content) and the prepare step's data report (`from: prepare.data`: it runs after the data step, whose cached entry it
reuses), its parameter the config itself; so a second `pipeline run` reuses it, and a change to the data or the config
runs it again, like any other step. Its outputs are the search's folder (`automl`) and the config it searched (`config`),
published under `<output_dir>.steps/automl/` and compiled for Kubeflow like any step of one's own.
"""

from __future__ import annotations

from pathlib import Path

from trainpipe.config import RunConfig
from trainpipe.config.steps import CustomStepConfig
from trainpipe.pipeline.steps import PipelineError

STEP_FILE = Path(__file__).resolve().parents[1] / "tune" / "steps" / "automl_step.py"
NAME = "automl"


def with_automl_step(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the `automl` step added to `pipeline.steps` (unchanged without `pipeline.automl`)."""
    if not cfg.pipeline.automl:
        return cfg
    if cfg.automl is None or cfg.automl.task != "tabular":
        raise PipelineError("`pipeline.automl: true` adds AutoGluon's search of the table as a step, and the config has no `automl: {task: tabular}` "
                            "section. Add one (e.g. `automl: {task: tabular, time_limit: 120}`), or set `pipeline.automl: false`.")
    if cfg.stages or cfg.method.adapters or not cfg.pipeline.builtin:
        raise PipelineError("`pipeline.automl: true` runs beside the one built-in chain (it reads its prepare step); a config with `stages`, "
                            "`method.adapters` or `pipeline.builtin: false` has no such chain. Run `trainpipe automl CONFIG --task tabular` on its own.")
    paths = [s.path for s in cfg.data.sources if s.path is not None]
    dump = cfg.model_dump(mode="json", exclude={"pipeline", "tune", "stages", "output_dir"})
    spec = CustomStepConfig.model_validate({
        "name": NAME, "function": f"{STEP_FILE}:run_step",
        "inputs": {"prepared": {"from": "prepare.data", "type": "any"}, **{f"source{i}": {"path": p} for i, p in enumerate(paths)}},
        "outputs": {"automl": "folder", "config": "file"}, "params": {"config": dump}, "resources": {"cpu": 2, "memory": "8Gi"}})
    return cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"steps": [*cfg.pipeline.steps, spec]})})
