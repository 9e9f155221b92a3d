"""Loading a run config: the YAML read safely (bounded against alias bombs), `--set a.b=c` overrides, then
defaults < YAML file < overrides validated into a RunConfig with its relative paths resolved (one file: the path a
config value takes from the YAML to the RunConfig)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainpipe.config.family import resolve_family, resolve_task
from trainpipe.config.messages import format_validation_error
from trainpipe.config.run import RunConfig
from trainpipe.errors import ConfigError
from trainpipe.metrics import TASK_METRICS, in_training_metrics, metric_direction, metric_key
from trainpipe.redact import redact_obj, register_secrets


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (``1e-4`` -> float, ``[q,v]`` -> list)."""
    if "=" not in text:
        raise ConfigError(
            f"`--set {text}` is not an override: write `--set key.path=value`, e.g. `--set training.learning_rate=1e-4`.",
            [f"--set {text}: missing `=`"],
        )
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"`--set {text}`: the key path `{key}` is empty or has an empty part.", [f"--set {text}"])
    try:
        value = load_yaml_text(raw, f"`--set {text}`") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``a.b=c`` override set (creating sections as needed)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
                node[part] = nxt
            elif not isinstance(nxt, dict):
                raise ConfigError(
                    f"`--set {text}`: `{'.'.join(path[: i + 1])}` is a value, not a section, so it has no key `{path[i + 1]}`.",
                    [f"--set {text}"],
                )
            node = nxt
        node[path[-1]] = value
    return out


MAX_YAML_ALIASES = 1_000  # `*name` uses in one document: configs use a handful
MAX_YAML_NODES = 200_000  # values after every alias is expanded: a config has hundreds; a "billion laughs" file billions
MAX_YAML_CHARS = 16 << 20  # characters of text after every alias is expanded: one 1 MB anchor used 300 times is 300 MB


class _YamlTooBig(Exception):
    pass


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses an alias bomb while composing, before anything is built: more than
    MAX_YAML_ALIASES alias uses, or more than MAX_YAML_NODES values once every alias is expanded (nine nested anchors
    of nine aliases each are 81 aliases but 9^9 values: safe_load builds them as shared objects, and the first thing that
    walks them, a validator or a dump, runs for ever)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _YamlTooBig(f"uses more than {MAX_YAML_ALIASES:,} aliases (`*name`)")
        return super().compose_node(parent, index)

    def construct_document(self, node):
        sizes: dict[int, tuple[int, int]] = {}

        def size(n) -> tuple[int, int]:  # (values, characters) once every alias is expanded
            if id(n) in sizes:
                return sizes[id(n)]
            parts = list(n.value) if isinstance(n, yaml.SequenceNode) else [x for kv in n.value for x in kv] if isinstance(n, yaml.MappingNode) else []
            subs = [size(c) for c in parts]
            total = (1 + sum(s[0] for s in subs), (len(n.value) if isinstance(n, yaml.ScalarNode) else 0) + sum(s[1] for s in subs))
            if total[0] > MAX_YAML_NODES:
                raise _YamlTooBig(f"expands to more than {MAX_YAML_NODES:,} values once its aliases (`*name`) are filled in")
            if total[1] > MAX_YAML_CHARS:
                raise _YamlTooBig(f"expands to more than {MAX_YAML_CHARS >> 20} MB of text once its aliases (`*name`) are filled in")
            sizes[id(n)] = total
            return total

        size(node)
        return super().construct_document(node)


def load_yaml_text(text: str, source: str):
    """``yaml.safe_load`` of ``text`` through BoundedLoader: every config trainpipe reads (a run config, best.yaml,
    config.resolved.yaml, a ``--set`` value). ``source`` names it in the error: an alias bomb or nesting too deep is a
    ConfigError (one paragraph); a syntax error stays ``yaml.YAMLError`` for the caller to place."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - BoundedLoader is a SafeLoader
    except _YamlTooBig as exc:
        raise ConfigError(
            f"{source} was refused: its YAML {exc}, the shape of an alias bomb (\"billion laughs\": nested anchors `&a` "
            "whose aliases `*a` multiply), which would exhaust memory or never finish. Write the values out, or use far fewer "
            "anchors and aliases.") from None
    except RecursionError:
        raise ConfigError(f"{source} was refused: its YAML nests lists or mappings too deeply to read (thousands of levels). "
                          "A run config is a few levels deep; fix the brackets or indentation.") from None


def read_yaml_file(path: str | Path, what: str = "Config file") -> Any:
    """The YAML document of ``path`` (BoundedLoader); a missing file, a folder, bytes that are not UTF-8 text and bad
    syntax are ConfigErrors naming the file."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} `{p}` is a folder, not a file. Pass the YAML file itself (e.g. `{p}/run.yaml`).")
    if not p.is_file():
        raise ConfigError(f"{what} `{p}` does not exist. Check the path, or start from `examples/quickstart/run.yaml`.")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} `{p}` is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): is it a binary file? "
                          "A config is a YAML text file; check the path.") from None
    try:
        return load_yaml_text(text, f"`{p}`")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"`{p}` is not valid YAML{where}: {problem}. Fix the syntax there (indentation, a missing `:` or quote).") from None


def read_yaml(path: str | Path) -> dict:
    """Read a config file (``read_yaml_file``: safe, bounded); YAML syntax errors name the line."""
    p = Path(path)
    data = read_yaml_file(p)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"`{p}` must hold a mapping of sections (model, data, ...), got a {type(data).__name__}.")
    return data


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
    if mp is not None and (mp.startswith((".", "/", "~")) or (base_dir / Path(mp).expanduser()).exists()):
        cfg.model.name_or_path = resolve(mp)
    for holder, key in ((cfg.model, "factory"), (cfg.method, "loss"), *((d, "factory") for d in datas)):  # `file.py:function`: relative to the config file
        spec = getattr(holder, key)
        if isinstance(spec, str) and ".py:" in spec:
            file, _, fn = spec.rpartition(":")
            setattr(holder, key, f"{resolve(file)}:{fn}")
    return cfg


def build_config(data: dict, *, source: str = "config", base_dir: Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Validate a config mapping (after applying overrides) into a RunConfig."""
    data = apply_overrides(data, overrides or [])
    register_secrets(data)  # its URL and DSN credentials are masked wherever they appear later (an error message, a label)
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
    if resolve_family(cfg.model, cfg.data)[0] != "text":  # tabular, custom, image: the task's metrics at every eval
        during = TASK_METRICS[resolve_task(cfg.method, cfg.data)[0]]
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
