"""The tracking libraries behind one small interface (`Backend`): MLflow, W&B, TensorBoard, each imported only when used.
track/tracking.py drives them (live during a run, and `sync_run` at its end or from `trainpipe track sync`)."""

from __future__ import annotations

import os
from pathlib import Path


class Backend:
    """One tracking library behind four calls; every call may raise when the tracker is unreachable."""

    name = "none"

    def open(self, state: dict, params: dict, tags: dict) -> str: ...

    def log_metrics(self, values: dict[str, float], step: int, timestamp: float) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_artifacts(self, run_dir: Path, files: list[Path], model_dir: Path | None) -> None: ...

    def register(self, name: str, tags: dict[str, str]) -> dict | None:
        return None

    def close(self, status: str) -> None: ...


class MlflowBackend(Backend):
    name = "mlflow"

    def __init__(self, settings: dict):
        # an unreachable server fails in seconds, not after MLflow's default minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        import logging

        logging.getLogger("alembic").setLevel(logging.WARNING)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        from mlflow import MlflowClient

        self.settings = settings
        self.uri = settings["uri"]
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.run_id: str | None = None
        self.model_uri: str | None = None

    def _artifact_location(self) -> str | None:
        if self.uri.startswith("sqlite:///"):  # a local store: artefacts beside the database
            return Path(self.uri[len("sqlite:///"):]).parent.joinpath("mlartifacts").as_uri()
        return None  # a server decides (its --default-artifact-root / proxied artefacts)

    def open(self, state: dict, params: dict, tags: dict) -> str:
        from mlflow.exceptions import MlflowException

        if state.get("run_id"):
            try:
                run = self.client.get_run(state["run_id"])
                self.run_id = run.info.run_id
                if run.info.status != "RUNNING":
                    self.client.update_run(self.run_id, status="RUNNING")
                return self.run_id
            except MlflowException:
                pass  # another store than the one the run started on: a new run there
        exp = self.client.get_experiment_by_name(self.settings["experiment"])
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.settings["experiment"], artifact_location=self._artifact_location())
        run = self.client.create_run(exp_id, run_name=tags.get("mlflow.runName"), tags=tags)
        self.run_id = run.info.run_id
        return self.run_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100], synchronous=True)

    def log_metrics(self, values: dict[str, float], step: int, timestamp: float) -> None:
        from mlflow.entities import Metric

        ms = [Metric(k, v, int(timestamp * 1000), int(step)) for k, v in values.items()]
        if ms:
            self.client.log_batch(self.run_id, metrics=ms, synchronous=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k[:250], str(v)[:5000]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[i:i + 100], synchronous=True)

    def log_artifacts(self, run_dir: Path, files: list[Path], model_dir: Path | None) -> None:
        for f in files:
            self.client.log_artifact(self.run_id, str(f))
        if model_dir is not None and model_dir.is_dir():
            self.client.log_artifacts(self.run_id, str(model_dir), artifact_path="model")
            self.model_uri = f"runs:/{self.run_id}/model"

    def register(self, name: str, tags: dict[str, str], description: str | None = None) -> dict | None:
        from mlflow.exceptions import MlflowException

        if self.model_uri is None:
            return None
        try:
            self.client.get_registered_model(name)
        except MlflowException:
            self.client.create_registered_model(name, tags={"trainpipe": "1"}, description="Registered by trainpipe; see each version's lineage "
                                                "and quality-gate tags (`trainpipe.gates.passed`).")
        source = self.client.get_run(self.run_id).info.artifact_uri.rstrip("/") + "/model"
        mv = self.client.create_model_version(name, source=source, run_id=self.run_id, tags={k[:250]: str(v)[:5000] for k, v in tags.items()},
                                              description=description)
        return {"name": name, "version": str(mv.version), "source": source}

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class WandbBackend(Backend):
    name = "wandb"

    def __init__(self, settings: dict, run_dir: Path):
        self.settings, self.run_dir, self.run = settings, Path(run_dir), None

    def open(self, state: dict, params: dict, tags: dict) -> str:
        import wandb

        if self.settings.get("uri"):
            os.environ.setdefault("WANDB_BASE_URL", self.settings["uri"])
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=self.settings["experiment"], name=tags.get("mlflow.runName"), id=state.get("run_id") or None, resume="allow",
            dir=str(self.run_dir), mode=self.settings["mode"], config=params, reinit="finish_previous",
            settings=wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, save_code=False, disable_git=True, program="trainpipe"),
        )
        self.run.tags = tuple(sorted({str(v)[:64] for k, v in tags.items() if k.startswith("trainpipe.") and len(str(v)) <= 64}))[:20]
        return self.run.id

    def log_metrics(self, values: dict[str, float], step: int, timestamp: float) -> None:
        self.run.log(values, step=int(step))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.run.summary.update({k: v for k, v in tags.items()})

    def log_artifacts(self, run_dir: Path, files: list[Path], model_dir: Path | None) -> None:
        import wandb

        art = wandb.Artifact(f"{self.run.name or 'run'}-files".replace("/", "-"), type="run-files")
        for f in files:
            art.add_file(str(f))
        self.run.log_artifact(art)
        if model_dir is not None and model_dir.is_dir():
            model = wandb.Artifact(self.settings["model_name"], type="model")
            model.add_dir(str(model_dir))
            self.run.log_artifact(model)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class TensorBoardBackend(Backend):
    name = "tensorboard"

    def __init__(self, settings: dict):
        self.settings, self.writer = settings, None

    def open(self, state: dict, params: dict, tags: dict) -> str:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=self.settings["uri"])
        return self.settings["uri"]

    def log_params(self, params: dict) -> None:
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()), 0)

    def log_metrics(self, values: dict[str, float], step: int, timestamp: float) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=int(step), walltime=timestamp)

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.writer.add_text(k, str(v), 0)

    def log_artifacts(self, run_dir: Path, files: list[Path], model_dir: Path | None) -> None:
        self.writer.add_text("artifacts", "\n".join(f"    {f}" for f in files) + (f"\n    model: {model_dir}" if model_dir else ""), 0)

    def close(self, status: str) -> None:
        self.writer.flush()
        self.writer.close()


def make_backend(settings: dict, run_dir: Path) -> Backend:
    if settings["backend"] == "mlflow":
        return MlflowBackend(settings)
    if settings["backend"] == "wandb":
        return WandbBackend(settings, run_dir)
    if settings["backend"] == "tensorboard":
        return TensorBoardBackend(settings)
    return Backend()
