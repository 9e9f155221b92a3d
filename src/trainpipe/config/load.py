"""Loading a run config: defaults < YAML file < `--set` overrides, validated, relative paths resolved."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from trainpipe.config.messages import format_validation_error
from trainpipe.config.run import RunConfig
from trainpipe.config.yaml_io import apply_overrides, read_yaml
from trainpipe.errors import ConfigError
from trainpipe.metrics import in_training_metrics, metric_direction, metric_key
from trainpipe.redact import redact_obj


def _resolve_paths(cfg: RunConfig, base_dir: Path) -> RunConfig:
    def resolve(p: str) -> str:
        path = Path(p).expanduser()
        return str(path if path.is_absolute() else (base_dir / path).resolve())

    datas = ([cfg.data] if cfg.data is not None else []) + [a.data for a in cfg.method.adapters] + [s.data for s in cfg.stages or [] if s.data is not None]
    for data in datas:  # the run's data, each adapter's and each stage's
        for src in data.sources:
            if src.path is not None:
                src.path = resolve(src.path)
            if src.sql is not None and src.sql.url.startswith("sqlite:///") and not src.sql.url.startswith("sqlite:////"):
                rel = src.sql.url[len("sqlite:///"):]
                if rel and rel != ":memory:":
                    src.sql.url = "sqlite:///" + resolve(rel)
        dec = data.decontamination
        dec.benchmarks = [resolve(b) for b in dec.benchmarks]
        if data.cache_dir is not None:
            data.cache_dir = resolve(data.cache_dir)
    rls = [cfg.method.rl.__dict__] + [st.method["rl"] for st in cfg.stages or [] if isinstance(st.method.get("rl"), dict)]
    for rl in rls:  # the run's and each stage's rl settings
        rf = rl.get("reward_function")
        if isinstance(rf, str) and ".py:" in rf:  # `path/to/file.py:function`: the file is relative to the config file
            file, _, fn = rf.rpartition(":")
            rl["reward_function"] = f"{resolve(file)}:{fn}"
        rm = rl.get("reward_model")
        if isinstance(rm, str) and (rm.startswith((".", "~")) or (base_dir / rm).exists()):
            rl["reward_model"] = resolve(rm)
    for fs in cfg.eval.forgetting:  # forgetting sets and local benchmark task folders: relative to the config file
        fs.path = resolve(fs.path)
    for bm in cfg.eval.benchmarks:
        if bm.include_path is not None:
            bm.include_path = resolve(bm.include_path)
    if cfg.model.init_from_config is not None:
        cfg.model.init_from_config = resolve(cfg.model.init_from_config)
    mp = cfg.model.name_or_path
    local = Path(mp).expanduser()
    if mp.startswith((".", "/", "~")) or (base_dir / local).exists():
        cfg.model.name_or_path = resolve(mp)
    return cfg


def build_config(data: dict, *, source: str = "config", base_dir: Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Validate a config mapping (after applying overrides) into a RunConfig."""
    data = apply_overrides(data, overrides or [])
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc, source) from None
    _check_metric_for_best(cfg, source)
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    return cfg


def _check_metric_for_best(cfg: RunConfig, source: str) -> None:
    """Refuse a `training.metric_for_best` the recipe's in-training eval never measures (trainpipe/metrics.py knows what each
    measures), before anything trains. A config whose method is `auto` or that holds stages/adapters is checked per stage / adapter
    while its DAG is built (pipeline/stages.py `check_branch`)."""
    if cfg.training.metric_for_best == "loss" or cfg.stages or cfg.method.adapters or cfg.method.name == "auto":
        return
    name = cfg.training.metric_for_best
    during = in_training_metrics(cfg.method.name, cfg.eval.metrics, cfg.eval.generate_in_training)
    if metric_key(name) not in during:
        raise ConfigError(
            f"{source}: `training.metric_for_best: {name}` is not measured by the in-training evals of a `{cfg.method.name}` run with this "
            f"config (they measure {', '.join(during)}), so no checkpoint could be ranked by it. Choose one of those"
            + (", or set `eval.generate_in_training: true` to generate and score at every eval (slower)" if cfg.method.name in ("sft", "pretrain") else "")
            + ".",
            [f"training.metric_for_best: {name}"],
        )
    if cfg.training.greater_is_better is None:  # the direction from tune's one table; a metric without one is refused, not guessed
        try:
            metric_direction(name, key="training.greater_is_better", field="training.metric_for_best")
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc.message}", exc.problems) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """defaults < YAML file < overrides, validated; relative paths resolved against the file."""
    p = Path(path)
    cfg = build_config(read_yaml(p), source=f"`{p}`", base_dir=p.resolve().parent, overrides=overrides)
    if cfg.name is None:
        cfg.name = p.stem if p.stem != "run" else p.resolve().parent.name
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    """The config as YAML, credentials redacted (a URL's password -> `***`, trainpipe.redact): what config.resolved.yaml
    and every checkpoint hold. `cfg.hash()` still covers the real values."""
    return yaml.safe_dump(redact_obj(cfg.model_dump(mode="json")), sort_keys=False, default_flow_style=None, width=100)


def json_schema() -> dict:
    schema = RunConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "trainpipe RunConfig"
    return schema
