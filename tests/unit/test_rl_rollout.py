"""Who samples RL's completions and under which seeds (train/rollout.py).

- The `method.rl.rollout` rule: generate on the CPU (auto says why), vllm only on CUDA with vLLM installed and
  unsharded weights, an explicit `vllm` that cannot run is a clear error.
- Per-prompt seeds: the same prompts at the same step give the same seeds, another step or a repeat of a prompt
  in the window another seed; the `generate` path samples a prompt's completions identically whatever prompts share
  its window and whatever the torch RNG's state (a resumed process starts from another RNG state).
- The colocated vLLM path, with FakeVLLMEngine standing in for vLLM's `LLM` (vLLM needs CUDA: it cannot be installed
  or run here). The stand-in holds a real copy of the tiny Llama, loads the weights it is sent by name (an unknown
  name is an error) and samples with the request's seed. Checked: the engine sleeps at start; before each rollout it
  wakes its weights, gets every weight of the policy (a LoRA adapter merged in), resets its cache, wakes its KV cache,
  generates, and sleeps again; after an optimizer step the next rollout samples from the updated weights.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

from trainpipe.config import RLConfig  # noqa: E402
from trainpipe.errors import ConfigError  # noqa: E402
from trainpipe.train.rl_policy import PolicyGradient  # noqa: E402
from trainpipe.train.rollout import VLLMRollout, choose_rollout, generate_rollout, prompt_seeds  # noqa: E402


def test_rollout_rule():
    assert choose_rollout("auto", device_type="cpu", installed=True) == ("generate", "auto: the run is on cpu, and vLLM needs a CUDA GPU")
    name, why = choose_rollout("auto", device_type="cuda", installed=False)
    assert name == "generate" and "not installed" in why
    name, why = choose_rollout("auto", device_type="cuda", installed=True, sharded=True)
    assert name == "generate" and "sharded" in why
    assert choose_rollout("auto", device_type="cuda", installed=True)[0] == "vllm"
    assert choose_rollout("generate", device_type="cuda", installed=True)[0] == "generate"
    assert choose_rollout("vllm", device_type="cuda", installed=True)[0] == "vllm"
    with pytest.raises(ConfigError, match="`method.rl.rollout: vllm` cannot run here: the run is on cpu"):
        choose_rollout("vllm", device_type="cpu", installed=True)


def test_prompt_seeds():
    a, b, c = [5, 6, 7], [8, 9], [5, 6]
    s = prompt_seeds(42, 3, [a, b, c])
    assert s == prompt_seeds(42, 3, [a, b, c]) and len(set(s)) == 3
    assert prompt_seeds(42, 3, [c, a])[::-1] == [s[0], s[2]]  # a prompt's seed does not depend on its neighbours
    assert set(prompt_seeds(42, 4, [a, b, c])).isdisjoint(s) and set(prompt_seeds(43, 3, [a, b, c])).isdisjoint(s)
    twice = prompt_seeds(42, 3, [a, a])
    assert twice[0] == s[0] and twice[1] != twice[0]  # the second copy of a prompt in a window samples anew
    assert all(0 <= x < 2**63 for x in s + twice)


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tok, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def objective(tok, rl=None, **kw):
    rl = rl or RLConfig(reward_function="x:y", num_generations=2, max_new_tokens=5)
    return PolicyGradient(tok, lambda p, c, pt, ct: [float(len(x)) for x in ct], rl, stop_ids=[tok.eos_token_id], seed=7, **kw)


def test_generate_rollouts_depend_on_the_prompt_and_seed_only(parts):
    tok, model = parts
    obj = objective(tok)
    a, b, c = [20, 21, 22, 23], [30, 31], [40, 41, 42]
    seeds = prompt_seeds(7, 0, [a, b])
    torch.manual_seed(0)
    first = generate_rollout(obj.sample, model, [a, b], seeds, 2, tok.pad_token_id)
    torch.manual_seed(123)  # another RNG state, as in a resumed process
    rng = torch.get_rng_state()
    again = generate_rollout(obj.sample, model, [c, a], [prompt_seeds(7, 0, [c])[0], seeds[0]], 2, tok.pad_token_id)
    assert again[2:] == first[:2]  # prompt a's two completions, though its neighbour and the RNG differ
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG (dropout) is left as it was
    assert first[0] != first[1]  # the group's completions are distinct samples


class FakeVLLMEngine:
    """A stand-in for vLLM's `LLM` (vLLM cannot run here: no CUDA). It keeps a real copy of the model, takes weights
    through `llm_engine.model_executor.driver_worker.model_runner.model.load_weights` as vLLM's colocated engine does,
    and samples each request with its `SamplingParams` seed. Every call is logged."""

    def __init__(self, model):
        self.hf, self.log, self.loaded = copy.deepcopy(model).eval(), [], set()
        with torch.no_grad():
            for p in self.hf.parameters():
                p.zero_()  # nothing of the policy until it is synced
        self.llm_engine = self  # llm_engine.model_executor.driver_worker.model_runner.model -> self
        self.model_executor = self.driver_worker = self.model_runner = self.model = self

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        for name, tensor in weights:
            with torch.no_grad():
                params[name].copy_(tensor)  # KeyError for a name the engine's model does not have
            self.loaded.add(name)
        if self.log[-1] != "load_weights":
            self.log.append("load_weights")

    def sleep(self, level):
        self.log.append(f"sleep{level}")

    def wake_up(self, tags):
        self.log.append("wake_" + "+".join(tags))

    def reset_prefix_cache(self):
        self.log.append("reset_prefix_cache")

    def generate(self, prompts, sampling_params, use_tqdm):
        from types import SimpleNamespace

        from transformers import GenerationConfig

        self.log.append("generate")
        outs = []
        for p, sp in zip(prompts, sampling_params):
            ids = torch.tensor([p["prompt_token_ids"]] * sp["n"])
            gen = GenerationConfig(do_sample=True, temperature=sp["temperature"], top_k=0, top_p=1.0, max_new_tokens=sp["max_tokens"],
                                   eos_token_id=sp["stop_token_ids"], pad_token_id=0)
            with torch.random.fork_rng(), torch.no_grad():
                torch.manual_seed(sp["seed"])
                out = self.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)[:, ids.shape[1]:]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=row.tolist()) for row in out]))
        return outs


@pytest.mark.parametrize("peft", [False, True])
def test_vllm_path_syncs_weights_each_step_and_sleeps_between(parts, peft):
    tok, base = parts
    policy = copy.deepcopy(base)
    if peft:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))  # a trained adapter: merging changes the weights
    engine = FakeVLLMEngine(base)
    rl = RLConfig(reward_function="x:y", num_generations=2, max_new_tokens=5, rollout="vllm")
    rollout = VLLMRollout(model_path="unused", rl=rl, stop_ids=[tok.eos_token_id], seed=7, max_model_len=64, llm=engine, sampling_params=dict)
    step = {"n": 0}
    obj = objective(tok, rl, rollout=rollout, step=lambda: step["n"], reference=copy.deepcopy(base).eval())
    obj.policy = policy
    window = [{"prompt_input_ids": [20, 21, 22]}, {"prompt_input_ids": [30, 31, 32, 33]}]
    obj.weight(window)
    per_rollout = ["wake_weights", "load_weights", "reset_prefix_cache", "wake_kv_cache", "generate", "sleep2"]
    assert engine.log == ["sleep2", *per_rollout]
    assert engine.loaded == set(dict(base.named_parameters()))  # every weight, under the engine's names (LoRA merged, not sent)
    x = torch.tensor([[20, 21, 22, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(engine.hf(x).logits, policy(input_ids=x).logits, atol=1e-5)  # the engine runs the policy's weights
    if peft:
        assert not policy.base_model.model.model.layers[0].self_attn.q_proj.merged  # the adapter is unmerged again after the sync
    first = obj._group.comp.clone()

    with torch.no_grad():  # an optimizer step changes the policy; the next step's rollout samples from the new weights
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    step["n"] = 1
    obj.weight(window)
    assert engine.log == ["sleep2", *per_rollout, *per_rollout] and rollout.synced_steps == [0, 1]
    with torch.no_grad():
        assert torch.allclose(engine.hf(x).logits, policy(input_ids=x).logits, atol=1e-5)
    assert not torch.equal(obj._group.comp, first)  # step 1's prompts get new seeds (and new weights)
