"""The objective rule (issue 15 item 1): each branch of the seeds' tree, in `trainpipe plan --goal/--data` and as
`method.name: auto` expanded to a concrete method or to `stages:` (config level; tests/e2e/test_method_auto.py trains)."""

import json

import pytest

from tiny import alpaca_records, preference_records, write_jsonl
from trainpipe.config import build_config
from trainpipe.plan.decisions import PlanError
from trainpipe.plan.objective import choose_objective, expand_auto


@pytest.mark.parametrize(
    "kw, stages, words",
    [
        ({"data": {"instruction"}}, ["sft"], "task adaptation"),
        ({"goal": "task", "data": {"instruction"}}, ["sft"], "SFT"),
        ({"goal": "knowledge", "data": {"text", "instruction"}}, ["pretrain", "sft"], "continued pre-training"),
        ({"goal": "vocabulary", "data": {"text", "instruction"}}, ["pretrain", "sft"], "vocabulary"),
        ({"goal": "knowledge", "data": {"text"}}, ["pretrain"], "add instruction data"),
        ({"data": {"text"}}, ["pretrain"], "raw domain text"),
        ({"data": {"preference"}, "kl_control": "high", "goal": "alignment"} | {"data": {"preference", "instruction"}}, ["sft", "reward", "rl"], "3 stages"),
        ({"data": {"preference"}, "kl_control": "low"}, ["dpo"], "DPO"),
        ({"data": {"preference", "instruction"}, "kl_control": "low"}, ["sft", "dpo"], "DPO"),
        ({"goal": "multitask", "data": {"instruction"}}, ["sft"], "one LoRA adapter per task"),
        ({"data": {"instruction"}, "tasks": 3}, ["sft"], "3 tasks"),
    ],
)
def test_each_branch_of_the_tree(kw, stages, words):
    c = choose_objective(**kw)
    assert c.stages == stages and words in c.rule and c.watch
    assert c.decisions[-1].key == "objective" and c.decisions[-1].value == c.value
    assert c.adapters == (kw.get("goal") == "multitask" or kw.get("tasks", 1) > 1)


def test_first_time_vs_continued():
    first = choose_objective(data={"instruction"})
    again = choose_objective(data={"instruction"}, continued=True)
    assert first.decisions[0].value is False and again.decisions[0].value is True
    assert "halve the learning rate" in again.decisions[0].rule and "forgetting" in again.decisions[0].watch
    assert again.stages == first.stages  # continued keeps the objective the data calls for


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"goal": "knowledge", "data": {"instruction"}}, "raw domain text"),
        ({"data": {"preference"}, "kl_control": "high"}, "instruction data"),
        ({"goal": "bogus", "data": {"instruction"}}, "method.goal=bogus"),
        ({"data": set()}, "--data"),
    ],
)
def test_impossible_branches_say_what_is_missing(kw, needle):
    with pytest.raises(PlanError) as e:
        choose_objective(**kw)
    assert needle in e.value.message


def _cfg(tmp_path, sources, **method):
    return build_config({"model": {"name_or_path": "m"}, "data": {"sources": sources}, "method": {"name": "auto", **method}}, base_dir=tmp_path)


def _files(tmp_path):
    a = write_jsonl(tmp_path / "sft.jsonl", alpaca_records(4))
    p = write_jsonl(tmp_path / "pairs.jsonl", preference_records(4))
    t = tmp_path / "text.jsonl"
    t.write_text("\n".join(json.dumps({"text": f"domain text {i}"}) for i in range(4)) + "\n")
    return str(a), str(p), str(t)


def test_method_auto_instruction_data_is_sft(tmp_path):
    a, _, _ = _files(tmp_path)
    cfg, c = expand_auto(_cfg(tmp_path, [{"path": a}]))
    assert cfg.method.name == "sft" and cfg.stages is None and c.stages == ["sft"]


def test_method_auto_preference_low_kl_is_dpo(tmp_path):
    _, p, _ = _files(tmp_path)
    cfg, _ = expand_auto(_cfg(tmp_path, [{"path": p}]))
    assert cfg.method.name == "dpo" and cfg.stages is None


def test_method_auto_high_kl_expands_to_three_stages_each_with_its_data(tmp_path):
    a, p, _ = _files(tmp_path)
    cfg, _ = expand_auto(_cfg(tmp_path, [{"path": a}, {"path": p}], kl_control="high"))
    assert [s.method["name"] for s in cfg.stages] == ["sft", "reward", "rl"]
    assert [[src.path for src in s.data.sources] for s in cfg.stages] == [[a], [p], [a]]


def test_method_auto_new_knowledge_is_pretrain_then_sft(tmp_path):
    a, _, t = _files(tmp_path)
    cfg, _ = expand_auto(_cfg(tmp_path, [{"path": t}, {"path": a}], goal="knowledge"))
    assert [s.name for s in cfg.stages] == ["pretrain", "sft"]
    assert [s.data.sources[0].path for s in cfg.stages] == [t, a]


def test_method_auto_continued_halves_the_default_lr(tmp_path):
    a, _, _ = _files(tmp_path)
    cfg, _ = expand_auto(_cfg(tmp_path, [{"path": a}], continued=True))
    assert cfg.training.learning_rate == pytest.approx(2e-4 / 2)
    cfg, _ = expand_auto(_cfg(tmp_path, [{"path": a}]))
    assert cfg.training.learning_rate is None  # first time: the resolver's default applies


def test_plan_cli_prints_the_objective_rule(capsys):
    from trainpipe.cli import main

    assert main(["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "A100-80GB", "--set", "method.goal=alignment", "--data", "preference",
                 "--data", "instruction", "--set", "method.kl_control=high", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    obj = next(d for d in p["decision"] if d["key"] == "objective")
    assert obj["value"] == "sft -> reward -> rl" and "KL" in obj["rule"] and obj["watch"]
    assert p["objective"]["stages"] == ["sft", "reward", "rl"]


def test_plan_cli_reads_the_data_kind_from_a_file(tmp_path, capsys):
    from trainpipe.cli import main

    _, p, _ = _files(tmp_path)
    assert main(["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "A100-80GB", "--data", p, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"]["stages"] == ["dpo"]


def test_plan_config_with_method_auto_plans_the_first_stage(tmp_path, capsys):
    import yaml

    from trainpipe.cli import main

    _, p, _ = _files(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}, "data": {"sources": [{"path": p}]}, "method": {"name": "auto"}}))
    assert main(["plan", str(cfg), "--gpu", "A100-80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"]["stages"] == ["dpo"] and out["plan"]["learning_rate"]["value"] == 5e-6  # DPO's adapter lr, not SFT's
    assert main(["plan", str(cfg), "--gpu", "A100-80GB", "--set", "method.kl_control=high", "--json"]) == 2  # SFT -> reward -> RL needs instruction data
    assert "instruction data" in capsys.readouterr().out


def test_config_show_expands_method_auto(tmp_path, capsys):
    import yaml

    from trainpipe.cli import main

    a, _, t = _files(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}, "data": {"sources": [{"path": t}, {"path": a}]},
                                   "method": {"name": "auto", "goal": "knowledge"}}))
    assert main(["config", "show", str(cfg)]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert [s["name"] for s in shown["stages"]] == ["pretrain", "sft"] and shown["method"]["name"] == "pretrain"
