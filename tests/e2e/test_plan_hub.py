"""`trainpipe plan --model ID` for models the catalogue lacks (issue 14 item 6).

Online it reads config.json alone from the hub (`huggingface_hub.hf_hub_download(repo_id, "config.json")`). There is
no network here, so the hub is a tiny local HTTP server started by the test that answers in the hub's URL layout
(`/{repo}/resolve/{revision}/config.json`, with the `X-Repo-Commit` and `ETag` headers huggingface_hub requires), and
`HF_ENDPOINT` points at it: a real HTTP exchange through huggingface_hub, not a mock. Each run is a subprocess
(huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported). Offline, the error names both fixes.
"""

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.e2e

# config.json of models the catalogue lacks, as their hub repositories publish them (the fields that shape the model)
CONFIGS = {
    "TinyLlama/TinyLlama_v1.1": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
        "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    },
    "stabilityai/stablelm-base-alpha-3b": {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 16,
        "num_attention_heads": 32, "vocab_size": 50688, "max_position_embeddings": 4096, "rotary_pct": 0.25, "use_parallel_residual": True,
        "hidden_act": "gelu", "tie_word_embeddings": False,
    },
    "Qwen/Qwen-1_8B": {  # Qwen 1: remote code (model_type qwen), planned as the equivalent qwen2 layout
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen", "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig"},
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 151936,
        "kv_channels": 128, "seq_length": 8192, "no_bias": True,
    },
}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub(BaseHTTPRequestHandler):
    seen: list[str] = []

    def _answer(self, body: bool) -> None:
        Hub.seen.append(f"{self.command} {self.path}")
        parts = self.path.split("?")[0].strip("/").split("/")
        repo, rest = "/".join(parts[:2]), parts[2:]
        if repo not in CONFIGS or len(rest) < 3 or rest[0] != "resolve":
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
            return
        if "/".join(rest[2:]) != "config.json":
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", COMMIT)
            self.end_headers()
            return
        data = json.dumps(CONFIGS[repo]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"' + hashlib.sha1(data).hexdigest() + '"')
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_HEAD(self):  # noqa: N802 - http.server's naming
        self._answer(False)

    def do_GET(self):  # noqa: N802
        self._answer(True)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def hub():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def plan(args, tmp_path, *, endpoint=None, offline=False, driver=None):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_TOKEN")}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if offline:
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-c", DRIVER, *driver] if driver else [sys.executable, "-m", "trainpipe.cli", "plan", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


DRIVER = """
import json, sys
from trainpipe.errors import TrainpipeError
from trainpipe.plan.request import WhatIf, whatif_config
from trainpipe.plan.whatif import make_plan
out = {}
for repo in sys.argv[1:]:
    try:
        p = make_plan(whatif_config(repo), WhatIf(gpu="A100-80GB"))
        out[repo] = {"model": p["model"], "fits": p["fits"], "gpu": p["recommendation"]["gpu"]}
    except TrainpipeError as e:
        out[repo] = {"error": e.message}
print(json.dumps(out))
"""
EXPECT = {"TinyLlama/TinyLlama_v1.1": ("llama", 1.10), "stabilityai/stablelm-base-alpha-3b": ("gpt_neox", 3.64), "Qwen/Qwen-1_8B": ("qwen2", 1.84)}


def test_online_reads_only_config_json_from_the_hub(hub, tmp_path):
    """Three models the catalogue lacks (TinyLlama v1.1, StableLM alpha, an older Qwen with remote code) and one the hub
    lacks, in one process (the same make_plan the CLI calls; the CLI's own path is the next test)."""
    Hub.seen.clear()
    r = plan([], tmp_path, endpoint=hub, driver=[*EXPECT, "nobody/no-such-model"])
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for repo, (model_type, params_b) in EXPECT.items():
        p = got[repo]
        assert p["model"]["id"] == repo and p["model"]["source"] == "hub" and p["model"]["model_type"] == model_type, p
        assert p["model"]["params"] / 1e9 == pytest.approx(params_b, rel=0.03)
        assert p["fits"] is True and p["gpu"] == "A100-80GB"
    assert "did not give its config.json" in got["nobody/no-such-model"]["error"]
    files = {s.split()[1].split("?")[0] for s in Hub.seen}
    # config.json alone: no weights, no tokenizer, no remote code
    assert files == {f"/{repo}/resolve/main/config.json" for repo in EXPECT} | {"/nobody/no-such-model/resolve/main/config.json"}
    assert (tmp_path / "hf").exists()  # huggingface_hub's own cache took the files


def test_cli_online_json(hub, tmp_path):
    r = plan(["--model", "TinyLlama/TinyLlama_v1.1", "--gpu", "L4", "--json"], tmp_path, endpoint=hub)
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)
    assert p["model"]["source"] == "hub" and p["fits"] is True and p["recommendation"]["gpu"] == "L4"


def test_offline_error_names_both_fixes(tmp_path):
    r = plan(["--model", "TinyLlama/TinyLlama_v1.1", "--gpu", "L4"], tmp_path, offline=True)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "offline" in out and "unset HF_HUB_OFFLINE" in out and "folder" in out and "only config.json" in out
