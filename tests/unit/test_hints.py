"""Issue 14 item 8, hints: `diagnose` advises only keys the config accepts; an HF TrainingArguments / TRL / PEFT name
in the wrong place points to its trainpipe key; a wrong `columns:` mapping is reported once, naming the mapped column
and the source key; the end table states the examples each metric ran on."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from trainpipe.config import HF_NAMES, _all_keys, build_config, json_schema, load_config
from trainpipe.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart" / "run.yaml"


def _schema_paths() -> set[str]:
    return {p for paths in _all_keys().values() for p in paths}


def _schema_values() -> set[str]:
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            found.update(str(v) for v in node.get("enum", []))
            if "const" in node:
                found.add(str(node["const"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json_schema())
    return found


def _advised(module: Path) -> set[str]:
    """Every `backticked` token in the module's strings other than docstrings: what its findings tell the user."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out |= set(re.findall(r"`([^`\s]+(?::\s*[^`\s]+)?)`", n.value))
    return out


def test_every_key_diagnose_advises_is_one_the_config_accepts():
    paths, values = _schema_paths(), _schema_values()
    keys = {p.rpartition(".")[2] for p in paths}
    advised = _advised(REPO / "src" / "trainpipe" / "report" / "diagnose.py")
    dotted = {t for t in advised if re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+|\[\])+(:\s*\S+)?", t)}
    assert len(dotted) >= 5, advised  # the check sees the findings' advice
    bad = []
    for t in sorted(dotted):
        path, _, value = t.partition(":")
        path = path.replace("[]", "")
        if path not in paths:
            bad.append(f"`{t}`: no such key")
            continue
        if value.strip():  # `key: value` must validate as written
            try:
                load_config(QUICKSTART, [f"{path}={value.strip()}"])
            except ConfigError as exc:
                bad.append(f"`{t}`: {exc.message.splitlines()[-1]}")
    # a bare snake_case name in backticks is a key (somewhere in the config) or a value the config takes
    bare = {t for t in advised if re.fullmatch(r"[a-z][a-z0-9_]*", t)}
    bad += [f"`{t}`: neither a config key nor a config value" for t in sorted(bare) if t not in keys and t not in values]
    assert not bad, "diagnose advises what the config rejects:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- HF names in the wrong place


@pytest.mark.parametrize("override,points_to", [
    ("training.lora_r=8", "`method.lora.r`"),
    ("training.lora_alpha=16", "`method.lora.alpha`"),
    ("training.report_to=wandb", "`tracking.backend`"),
    ("training.per_gpu_train_batch_size=4", "`training.per_device_train_batch_size`"),
    ("training.evaluation_strategy=steps", "`training.eval_steps`"),
    ("training.max_seq_length=512", "`data.max_length`"),
    ("training.load_in_4bit=true", "`method.peft`"),
    ("fp16=true", "`training.fp16`"),  # a trainpipe key in the wrong section
    ("method.bf16=true", "`training.bf16`"),
    ("training.beta=0.1", "`method.preference.beta`"),
    ("training.output_dir=x", "`output_dir`"),
    ("training.dataloader_num_workers=4", "no data loader workers"),
])
def test_an_hf_name_in_the_wrong_place_points_to_its_trainpipe_key(override, points_to):
    with pytest.raises(ConfigError) as exc:
        load_config(QUICKSTART, [override])
    (problem,) = exc.value.problems
    key = override.split("=")[0]
    assert problem.startswith(f"`{key}`:") and points_to in problem, problem


def test_every_hf_name_points_to_a_real_key():
    paths = _schema_paths()
    for name, (path, note) in HF_NAMES.items():
        if path is None:
            assert note, name
        else:
            assert path.replace("[]", "") in paths, (name, path)


def test_a_typo_still_gets_the_nearest_key():
    with pytest.raises(ConfigError) as exc:
        build_config({"model": {"name_or_path": "x"}, "training": {"learnin_rate": 1e-4}})
    assert "did you mean `training.learning_rate`?" in exc.value.problems[0]


# --------------------------------------------------------------------------- columns mapping, once


def test_a_wrong_columns_mapping_is_reported_once_naming_both_names(tmp_path, capsys):
    from trainpipe.cli import main

    rows = [{"question": f"Say {i}.", "response": f"{i} said"} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"name_or_path": str(REPO / "examples" / "quickstart" / "base")},
           "data": {"sources": [{"path": "d.jsonl", "format": "alpaca", "columns": {"instruction": "question", "output": "answer"}}], "eval_split": 4},
           "output_dir": str(tmp_path / "out")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "c.yaml")]) == 2
    out = capsys.readouterr().out
    assert out.count("missing field `output`") == 1, out
    assert "maps `output` to the source field `answer`" in out and "(its fields: `question`, `response`)" in out


def test_auto_format_names_the_unmatched_mapping():
    from trainpipe.data import formats

    rec = formats.apply_columns({"q": "a", "r": "b"}, {"instruction": "question", "output": "r"})
    with pytest.raises(formats.FormatError, match=r"maps `instruction` to `question`, which this record does not have"):
        formats.detect(rec)


# --------------------------------------------------------------------------- the end table


def _table(summary: dict) -> str:
    from rich.console import Console

    from trainpipe.cli import _print_result

    con = Console(width=160, record=True, no_color=True)
    _print_result(con, "quickstart", summary)
    return con.export_text()


def test_the_end_table_states_the_examples_each_metric_ran_on():
    summary = {"data": {"eval_examples": 200}, "baseline": {"loss": 2.0, "exact_match": 0.1}, "final": {"loss": 1.0, "exact_match": 0.6},
               "metric_examples": {"loss": 200, "exact_match": 40}}
    text = _table(summary)
    assert "200 examples" not in text
    (em,) = [line for line in text.splitlines() if "exact_match" in line]
    (loss,) = [line for line in text.splitlines() if "loss" in line and "exact" not in line]
    assert em.rstrip(" │|").split()[-1] == "40" and loss.rstrip(" │|").split()[-1] == "200", text
    same = _table({**summary, "metric_examples": {"loss": 40, "exact_match": 40}})
    assert "(eval split, 40 examples)" in " ".join(same.split())


@pytest.mark.e2e
def test_sft_summary_counts_the_generations_exact_match_ran_on(tmp_path, tiny_model_dir):
    from tiny import chat_records, write_jsonl

    from trainpipe.cli import main

    write_jsonl(tmp_path / "d.jsonl", chat_records(40, seed=3))
    cfg = {"model": {"name_or_path": str(tiny_model_dir)},
           "data": {"sources": [{"path": "d.jsonl"}], "eval_split": 12, "max_length": 64},
           "training": {"max_steps": 2, "eval_steps": 2, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
           "eval": {"metrics": ["loss", "exact_match"], "max_samples": 5, "max_new_tokens": 4}, "output_dir": str(tmp_path / "run")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "c.yaml")]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["data"]["eval_examples"] == 12
    assert s["metric_examples"] == {"loss": 12, "exact_match": 5}
