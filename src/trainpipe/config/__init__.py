"""RunConfig: the one YAML file that describes a run.

Precedence is one rule: field defaults < the YAML file < ``--set a.b=c`` overrides.
Validation reports every problem at once, each with its dotted key path, the value
received and the rule; an unknown key gets the nearest valid key as a suggestion.

The field docstrings are the documentation: they become the JSON Schema
descriptions (``trainpipe config schema``).

Relative paths inside a config file (``model.name_or_path`` when it names a local
folder, ``data.sources[].path``) are resolved against the folder of that file;
``output_dir`` is resolved against the current working directory.

The package, one file per part: base.py (the section base), data.py, method.py (model and method), training.py
(training and distributed), evaluation.py (eval and gates), tune.py, run.py (RunConfig), messages.py (validation errors),
load.py (bounded YAML, `--set`, build_config, load_config, dump_yaml, json_schema).
"""

from __future__ import annotations

from trainpipe.config.base import RUN_NAME, SECTIONS, _Section
from trainpipe.config.data import (
    MAX_WEIGHT, DataConfig, DataSource, DecontamConfig, DedupConfig, FilterConfig, PiiConfig, SqlSource,
)
from trainpipe.config.evaluation import BenchmarkConfig, EvalConfig, ForgettingSetConfig, GateConfig, GatesConfig
from trainpipe.config.load import (
    MAX_YAML_ALIASES, MAX_YAML_NODES, BoundedLoader, _check_metric_for_best, _resolve_paths, apply_overrides, build_config, dump_yaml,
    json_schema, load_config, load_yaml_text, parse_override, read_yaml, read_yaml_file,
)
from trainpipe.config.messages import HF_NAMES, _all_keys, _dotted, _fields_at, _model_in, _moved_key_hint, format_validation_error
from trainpipe.config.method import (
    AdapterConfig, FreezeConfig, IA3Config, LoraConfig, MethodConfig, ModelConfig, PreferenceConfig, PretrainConfig,
    PromptTuningConfig, QuantizationConfig, RLConfig,
)
from trainpipe.config.run import PipelineConfig, RunConfig, StageConfig, TrackingConfig
from trainpipe.config.training import DistributedConfig, TrainingConfig
from trainpipe.config.tune import AutomlConfig, TuneConfig, TuneFidelity, TuneObjective

__all__ = [
    "RUN_NAME", "SECTIONS", "_Section",
    "MAX_WEIGHT", "DataConfig", "DataSource", "DecontamConfig", "DedupConfig", "FilterConfig", "PiiConfig", "SqlSource",
    "BenchmarkConfig", "EvalConfig", "ForgettingSetConfig", "GateConfig", "GatesConfig",
    "_check_metric_for_best", "_resolve_paths", "build_config", "dump_yaml", "json_schema", "load_config",
    "HF_NAMES", "_all_keys", "_dotted", "_fields_at", "_model_in", "_moved_key_hint", "format_validation_error",
    "AdapterConfig", "FreezeConfig", "IA3Config", "LoraConfig", "MethodConfig", "ModelConfig", "PreferenceConfig", "PretrainConfig",
    "PromptTuningConfig", "QuantizationConfig", "RLConfig",
    "PipelineConfig", "RunConfig", "StageConfig", "TrackingConfig",
    "DistributedConfig", "TrainingConfig",
    "AutomlConfig", "TuneConfig", "TuneFidelity", "TuneObjective",
    "MAX_YAML_ALIASES", "MAX_YAML_NODES", "BoundedLoader", "apply_overrides", "load_yaml_text", "parse_override", "read_yaml",
    "read_yaml_file",
]
