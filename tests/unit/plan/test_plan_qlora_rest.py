"""The planner follows `method.quantization.upcast_rest` (trainpipe's QLoRA keeps the non-quantized rest in the load
dtype by default, as TRL's SFTTrainer; `true` is PEFT's prepare_model_for_kbit_training, fp32 rest and residual stream):

- `estimate()` for an 8B QLoRA 1 x 8192 step is lower without the upcast, and each setting is within 10 % of the real
  training step traced at full size (plan/trace.py, which prepares the model through train/model.py's prepare_kbit);
- a run config's `upcast_rest` reaches the memory Setup, and the plan says what `false` would save (the plan run twice).
"""

import json

import pytest

from trainpipe.plan import memory as M
from trainpipe.plan.catalog import find_model
from trainpipe.plan.trace import trace_step

MODEL = "meta-llama/Llama-3.1-8B"
GIB = 1024**3


def _setup(upcast: bool) -> M.Setup:
    return M.Setup(method="qlora", precision="bf16", micro_batch=1, seq_len=8192, framework="trainpipe", qlora_upcast_rest=upcast)


def test_estimate_is_lower_without_the_upcast():
    spec = find_model(MODEL)
    lo, hi = M.estimate(spec, _setup(False)), M.estimate(spec, _setup(True))
    assert not M.kbit_prepared_fp32(_setup(False)) and M.kbit_prepared_fp32(_setup(True))
    # the rest (embeddings + lm_head + norms, ~1.05 B parameters) 2 B instead of 4 B, and the activations roughly halve
    rest = spec.total_params - spec.linear_params
    assert lo.weights_bytes == hi.weights_bytes - 2 * rest
    assert lo.activations_bytes < 0.75 * hi.activations_bytes
    assert lo.allocated_bytes < hi.allocated_bytes - 15 * GIB


@pytest.mark.parametrize("upcast", [False, True], ids=["default-16bit-rest", "upcast_rest-fp32"])
def test_estimate_within_ten_percent_of_the_traced_step(upcast):
    """Full size (32 layers, 8192 tokens), two steps on fake tensors: ~15-35 s each."""
    spec = find_model(MODEL)
    s = _setup(upcast)
    est = M.estimate(spec, s).allocated_bytes
    r = trace_step(spec, s, steps=2, record_events=False)
    err = (est - r.peak_bytes) / r.peak_bytes
    print(f"\n8B QLoRA 1x8192 upcast_rest={upcast}: planner {est / GIB:.2f} GiB, trace {r.peak_bytes / GIB:.2f} GiB ({100 * err:+.1f} %)")
    assert abs(err) <= 0.10, f"planner {est / GIB:.3f} GiB vs trace {r.peak_bytes / GIB:.3f} GiB ({100 * err:+.1f} %) at {r.phase}; split {r.split}"


def _plan_json(tmp_path, capsys, quantization: str, gpu: str = "H100-80GB", model: str = "") -> dict:
    from trainpipe.cli import main

    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"instruction": f"q{i}", "output": "a" * 40}) for i in range(20)) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{name_or_path: {MODEL}{model}}}\ndata: {{sources: [{{path: train.jsonl}}], max_length: 8192}}\n"
                   f"method: {{peft: qlora{quantization}}}\ntraining: {{per_device_train_batch_size: 1, gradient_checkpointing: false}}\n")
    assert main(["plan", str(cfg), "--gpu", gpu, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_a_config_follows_upcast_rest_and_says_what_false_saves(tmp_path, capsys):
    off = _plan_json(tmp_path, capsys, "")
    on = _plan_json(tmp_path, capsys, ", quantization: {upcast_rest: true}")
    assert off["setup"]["qlora_upcast_rest"] is False and on["setup"]["qlora_upcast_rest"] is True  # what `plan --trace` traces
    t_off, t_on = off["memory"]["per_device"]["total_bytes"], on["memory"]["per_device"]["total_bytes"]
    assert t_off < t_on
    assert not any("upcast_rest" in n for n in off["notes"])
    note = [n for n in on["notes"] if "upcast_rest: false" in n]
    assert len(note) == 1, on["notes"]
    assert f"{(t_on - t_off) / GIB:.1f} GiB less" in note[0] and f"{t_off / GIB:.1f} GiB" in note[0]


def test_a_float32_load_under_fp16_autocast_is_planned_with_the_fp32_rest(tmp_path, capsys):
    """On a GPU without bf16 (T4) `model.dtype: auto` loads the base in float32 (and `compute_dtype: auto` is float32):
    the rest is fp32 whatever upcast_rest says, so the plan keeps counting it so and offers no saving; an explicit
    `model.dtype: float16` there is the 16-bit rest again."""
    t4 = _plan_json(tmp_path, capsys, ", quantization: {upcast_rest: true}", gpu="T4")
    assert t4["setup"]["precision"] == "fp16" and t4["setup"]["qlora_upcast_rest"] is True
    assert not any("upcast_rest: false" in n for n in t4["notes"])
    assert _plan_json(tmp_path, capsys, "", gpu="T4")["setup"]["qlora_upcast_rest"] is True
    assert _plan_json(tmp_path, capsys, "", gpu="T4", model=", dtype: float16")["setup"]["qlora_upcast_rest"] is False
