"""`trainpipe plan` says what it assumed and never reads better than it is (issue 35, point 11): the sequence length
and batch it sized with (1024 is `data.max_length`'s default, said so), never `fits: yes` beside a host-RAM row that
says too little, KTO data planned as KTO (not DPO), and the interconnect a multi-node time assumes."""

import json

from trainpipe.cli import main


def _plan(capsys, *args):
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_sequence_length_batch_and_interconnect_are_stated(capsys):
    args = ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100", "--num-gpus", "8", "--nodes", "2", "--tokens", "1e8"]
    out = _plan(capsys, *args)
    assert "assumed: sequence length 1024 tokens (`data.max_length`'s default" in out and "effective batch 128" in out
    assert "interconnect: 2 nodes: ASSUMED infiniband between the nodes" in out
    p = json.loads(_plan(capsys, *args, "--json"))
    assert p["assumed"]["seq_len"] == 1024 and p["assumed"]["effective_batch"] == 128
    assert p["compute"]["scaling_efficiency"] == 0.97 and "ASSUMED infiniband" in p["compute"]["interconnect"]  # LoRA: a fifth of 15 %
    p = json.loads(_plan(capsys, "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100", "--set", "data.max_length=4096", "--json"))
    assert p["assumed"]["seq_len"] == 4096 and p["assumed"]["seq_len_from"] == "`data.max_length`"


def test_never_fits_yes_beside_too_little_host_ram(capsys):
    args = ["--model", "meta-llama/Llama-3.1-8B", "--gpu", "RTX-4090", "--num-gpus", "2", "--set", "method.peft=none", "--set",
            "distributed.strategy=zero3", "--set", "distributed.offload=optimizer+params", "--host-ram-gib", "16"]
    out = _plan(capsys, *args)
    assert "fits: " not in out and "GPU memory: RTX-4090 enough; overall: does not fit" in out and "DOES NOT FIT: the host lacks the RAM" in out
    p = json.loads(_plan(capsys, *args, "--json"))
    assert p["fits"] is False and next(d for d in p["decision"] if d["key"] == "host_ram")["value"] == "too little"


def test_kto_data_is_planned_as_kto(capsys, tmp_path):
    f = tmp_path / "kto.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}], "label": i % 2 == 0}) + "\n"
                         for i in range(4)))
    p = json.loads(_plan(capsys, "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100", "--data", str(f), "--json"))
    assert p["objective"]["stages"] == ["kto"] and "unpaired" in p["objective"]["rule"]
    p = json.loads(_plan(capsys, "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100", "--data", str(f), "--data", "instruction", "--json"))
    assert p["objective"]["stages"] == ["sft", "kto"]
