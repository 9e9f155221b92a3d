"""RunConfig: validation messages, overrides and precedence, schema, shipped examples."""

from pathlib import Path

import pytest
import yaml

from trainpipe.config import RunConfig, apply_overrides, build_config, json_schema, load_config
from trainpipe.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
MINIMAL = {"model": {"name_or_path": "org/model"}, "data": {"sources": [{"path": "train.jsonl"}]}}


def write(tmp_path, data, name="run.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def problems(data, overrides=None):
    with pytest.raises(ConfigError) as info:
        build_config(data, overrides=overrides)
    return info.value.problems


def test_defaults_follow_field_practice():
    cfg = build_config(MINIMAL)
    assert cfg.method.peft == "lora" and cfg.method.lora.r == 16 and cfg.method.lora.alpha == 32
    assert cfg.method.lora.target_modules == "attention"
    t = cfg.training
    assert (t.lr_scheduler_type, t.warmup_ratio, t.weight_decay, t.max_grad_norm) == ("cosine", 0.03, 0.01, 1.0)
    assert t.target_effective_batch_size == 32
    assert cfg.model.trust_remote_code is False


def test_unknown_section_suggests_nearest():
    errs = problems({**MINIMAL, "trainig": {"learning_rate": 1e-4}})
    assert errs == ["`trainig`: `trainig` is not a section; did you mean `training`?"]


def test_all_problems_reported_at_once_with_paths():
    bad = {
        "model": {"name_or_path": "x", "dtyp": "float32"},
        "data": {"sources": [{"path": "a.jsonl", "format": "alpacca"}], "eval_split": 3.5},
        "training": {"warmup_ratio": 3.0, "learnin_rate": 1e-4},
    }
    errs = problems(bad)
    assert len(errs) == 5
    joined = "\n".join(errs)
    assert "`model.dtyp`: `dtyp` is not a key of `model`; did you mean `model.dtype`?" in joined
    assert "`data.sources[0].format`: must be one of auto, alpaca, chat, sharegpt, preference, kto, text, classification (got 'alpacca'); did you mean `alpaca`?" in joined
    assert "`data.eval_split`" in joined and "(got 3.5)" in joined
    assert "`training.warmup_ratio`" in joined and "(got 3.0)" in joined
    assert "did you mean `training.learning_rate`?" in joined


def test_missing_required_keys():
    errs = problems({"training": {}})
    assert "`model`: required key is missing" in errs
    assert "`data`: required key is missing" in errs


def test_save_steps_need_not_be_a_multiple_of_eval_steps():
    # issue 14.2: a Young/Daly checkpoint interval and an expensive eval may disagree (tests/e2e/test_save_without_eval.py trains it)
    cfg = build_config(MINIMAL, overrides=["training.eval_steps=10", "training.save_steps=3"])
    assert (cfg.training.eval_steps, cfg.training.save_steps) == (10, 3)


def test_overrides_parse_yaml_values_and_create_sections():
    out = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=[q, v]", "d.e=0.5", "f=hello", "g=null"])
    assert out == {"a": {"b": 2, "c": ["q", "v"]}, "d": {"e": 0.5}, "f": "hello", "g": None}
    cfg = build_config(MINIMAL, overrides=["training.learning_rate=1e-4", "method.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.training.learning_rate == 1e-4 and cfg.method.lora.target_modules == ["q_proj", "v_proj"]


def test_override_of_unknown_key_is_reported_with_suggestion():
    errs = problems(MINIMAL, ["training.learning_rat=1e-4"])
    assert errs == ["`training.learning_rat`: `learning_rat` is not a key of `training`; did you mean `training.learning_rate`?"]


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="not an override"):
        apply_overrides({}, ["training.learning_rate"])


def test_precedence_defaults_file_set(tmp_path):
    p = write(tmp_path, {**MINIMAL, "training": {"learning_rate": 3e-4, "seed": 7}})
    cfg = load_config(p)
    assert cfg.training.learning_rate == 3e-4  # file beats default
    assert cfg.training.weight_decay == 0.01  # default kept
    cfg = load_config(p, ["training.learning_rate=1e-5"])
    assert cfg.training.learning_rate == 1e-5  # --set beats file
    assert cfg.training.seed == 7


def test_relative_data_paths_resolve_against_config_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    p = write(tmp_path / "sub", {**MINIMAL, "model": {"name_or_path": "./base"}})
    cfg = load_config(p)
    assert cfg.data.sources[0].path == str(tmp_path / "sub" / "train.jsonl")
    assert cfg.model.name_or_path == str(tmp_path / "sub" / "base")
    assert cfg.name == "sub"


def test_hub_id_is_left_alone(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.model.name_or_path == "org/model"


def test_yaml_syntax_error_names_line(tmp_path):
    p = write(tmp_path, "model:\n  name_or_path: x\ndata: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(p)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_config_hash_is_stable_and_sensitive():
    a, b = build_config(MINIMAL), build_config(MINIMAL)
    assert a.hash() == b.hash()
    assert build_config(MINIMAL, overrides=["training.seed=1"]).hash() != a.hash()


def test_schema_has_sections_and_descriptions():
    schema = json_schema()
    assert set(schema["properties"]) >= {"model", "data", "method", "training", "eval", "output_dir"}
    lr = schema["$defs"]["TrainingConfig"]["properties"]["learning_rate"]
    assert "Peak learning rate" in lr["description"]


def test_every_field_is_documented():
    def walk(model):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no docstring"
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(RunConfig)


EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(REPO)) for p in EXAMPLES])
def test_every_example_validates(path):
    cfg = load_config(path)
    datas = ([cfg.data] if cfg.data else []) + [a.data for a in cfg.method.adapters] + [s.data for s in cfg.stages or [] if s.data]
    assert datas
    for data in datas:
        for src in data.sources:
            assert src.path and Path(src.path).exists(), f"examples must ship their data ({src.path})"


def test_examples_exist():
    assert EXAMPLES, "examples/ has no YAML config"

