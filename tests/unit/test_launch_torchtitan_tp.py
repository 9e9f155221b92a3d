"""`trainpipe launch --emit torchtitan` carries the planner's tensor rule: 70B full fine-tuning on 2 nodes of 8 H100 is handed
over as FSDP x tensor parallelism (no offload, which torchtitan does not have), parsed by torchtitan's own `ConfigManager`."""

from __future__ import annotations

from test_launch_torchtitan import _emit, _flag, _parse


def test_70b_full_on_2_nodes_hands_fsdp_by_tensor_parallelism_to_torchtitan(tmp_path):
    script, args = _emit(tmp_path, "meta-llama/Llama-3.1-70B", 1024, 2)
    assert _flag(args, "--config") == "llama3_70b" and "# fits: True" in script
    c = _parse(args)
    tp, dp = c.parallelism.tensor_parallel_degree, c.parallelism.data_parallel_shard_degree
    assert tp in (2, 4, 8) and tp * dp == 16 and c.parallelism.pipeline_parallel_degree == 1
    assert c.training.seq_len == 1024


def test_megatron_bridge_is_refused_in_one_paragraph_and_nothing_is_written(tmp_path, capsys):
    """megatron-bridge 0.3.1 does not import without CUDA (transformer-engine loads cuDNN at `import megatron.bridge`) and pins
    transformers < 5, so its own parser cannot check an emitted config here: the target is named, refused, and writes nothing."""
    from trainpipe.cli import main

    (tmp_path / "train.jsonl").write_text('{"text": "one"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {name_or_path: meta-llama/Llama-3.1-70B}\ndata: {sources: [{path: train.jsonl}]}\n")
    assert main(["launch", str(cfg), "--emit", "megatron-bridge", "-o", str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr())
    assert "cudnn shared object not found" in err and "transformers < 5" in err and "--emit torchtitan" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
