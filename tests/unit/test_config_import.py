"""Migrating from LLaMA-Factory and axolotl (issue 35, point 12): their key names are mapped by meaning in the
validator's message (cutoff_len -> data.max_length, max_samples -> data.sources[].max_records, stage -> method.name,
adapter -> method.peft), and `trainpipe config import FILE.yaml` converts the example configs those projects publish
(tests/assets/foreign_configs, with source and licence) into valid trainpipe configs, listing what it could not convert."""

from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main
from trainpipe.config import build_config
from trainpipe.config.importer import import_config
from trainpipe.errors import ConfigError

FOREIGN = Path(__file__).parents[1] / "assets" / "foreign_configs"
INFO = FOREIGN / "dataset_info.json"


def test_foreign_keys_are_named_by_meaning():
    with pytest.raises(ConfigError) as e:
        build_config({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "x.jsonl"}]},
                      "cutoff_len": 1024, "max_samples": 10, "stage": "sft", "adapter": "lora"})
    msg = str(e.value)
    assert "in trainpipe it is `data.max_length`" in msg and "in trainpipe it is `data.sources[].max_records`" in msg
    assert "in trainpipe it is `method.name`" in msg and "in trainpipe it is `method.peft`" in msg
    assert "automl" not in msg and "eval.max_samples" not in msg and "`stages`" not in msg and "did you mean" not in msg


def test_llamafactory_sft_example():
    cfg, tool, notes, lost = import_config(FOREIGN / "llamafactory_llama3_lora_sft.yaml", INFO)
    assert tool == "llamafactory" and lost == []
    rc = build_config(cfg)
    assert rc.method.name == "sft" and rc.method.peft == "lora" and rc.method.lora.r == 8 and rc.method.lora.target_modules == "all-linear"
    assert rc.data.max_length == 2048 and rc.data.chat_template == "llama-3" and rc.data.num_proc == 16
    assert [(s.path, s.max_records) for s in rc.data.sources] == [("data/identity.json", 1000), ("data/alpaca_en_demo.json", 1000)]
    assert rc.training.learning_rate == 1e-4 and rc.training.gradient_accumulation_steps == 8 and rc.training.bf16 is True
    assert rc.output_dir == "saves/llama3-8b/lora/sft" and len(notes) == 6  # stage, 4 settings trainpipe does not need, ddp_timeout cap
    # without dataset_info.json the two datasets are listed, not guessed
    _, _, _, lost = import_config(FOREIGN / "llamafactory_llama3_lora_sft.yaml", FOREIGN / "missing.json")
    assert len(lost) == 2 and all("--dataset-info" in x for x in lost)


def test_llamafactory_dpo_example_and_dataset_info_entries(tmp_path):
    cfg, _, _, lost = import_config(FOREIGN / "llamafactory_llama3_lora_dpo.yaml", INFO)
    rc = build_config(cfg)
    assert lost == [] and rc.method.name == "dpo" and rc.method.preference.beta == 0.1 and rc.method.preference.loss_type == "sigmoid"
    assert [(s.path, s.format) for s in rc.data.sources] == [("data/dpo_en_demo.json", "preference")]
    f = tmp_path / "mix.yaml"
    f.write_text("model_name_or_path: m\nstage: kto\ndataset: kto_en_demo,wiki_demo,openorca,glaive_toolcall_en_demo,mllm_demo\n")
    cfg, _, _, lost = import_config(f, INFO)
    src = cfg["data"]["sources"]
    assert cfg["method"]["name"] == "kto" and [s.get("format") for s in src] == ["kto", "text", None, None, None]
    assert src[2] == {"hub": "Open-Orca/OpenOrca", "columns": {"instruction": "question", "output": "response", "system": "system_prompt"}}
    assert len(lost) == 1 and "images" in lost[0]


def test_axolotl_example_through_the_cli(tmp_path, capsys):
    out = tmp_path / "run.yaml"
    assert main(["config", "import", str(FOREIGN / "axolotl_llama3_lora_1b.yml"), "-o", str(out)]) == 0
    assert "6 setting(s) not converted" in capsys.readouterr().out
    text = out.read_text()
    assert "# not converted (6):" in text and "evals_per_epoch" in text and "# valid:" in text
    rc = build_config(yaml.safe_load(text))
    assert rc.model.name_or_path == "NousResearch/Llama-3.2-1B" and rc.method.peft == "lora" and rc.method.lora.r == 16
    assert rc.data.max_length == 2048 and rc.data.packing == "pack" and rc.data.eval_split == 0.1
    assert rc.training.per_device_train_batch_size == 2 and rc.training.optim == "adamw_8bit" and rc.model.attn_implementation == "flash_attention_2"
    assert [(s.hub, s.format) for s in rc.data.sources] == [("teknium/GPT4-LLM-Cleaned", "alpaca")]
