"""No code from elsewhere runs without being asked; names that reach a shell are safe (issue 22).

What main did: `eval.benchmarks[].include_path` loaded every YAML of the folder with lm-eval's function resolution (a
`!function evil.boom` in an unrelated sibling YAML imported and ran `evil.py`); a config `name` with a newline became
a shell command in the scripts `trainpipe launch` writes; `launch -o` wrote over whatever was there.

Each test here uses the real parts: lm-evaluation-harness on the tiny Llama, the CLI in process, bash itself on the
emitted scripts. The one fake is `torchrun` in the script test (a stand-in that prints its argv, named as such):
the real one would start GPU workers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "tests" / "assets" / "eval" / "reverse_words"


# ----------------------------------------------------------------------------- lm-eval task folders
def _evil_module(folder: Path, name: str, marker: Path) -> None:
    """``folder/name.py``: touches ``marker`` when imported and when its function is called."""
    (folder / f"{name}.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('imported')\n"
        "def boom(dataset):\n"
        f"    Path({str(marker)!r}).write_text('called')\n"
        "    return dataset\n"
    )


def _task_folder(tmp: Path) -> Path:
    folder = tmp / "tasks"
    folder.mkdir()
    for f in ASSET.iterdir():
        if f.suffix in (".yaml", ".jsonl"):
            shutil.copy(f, folder / f.name)
    return folder


def _task_with(folder: Path, task: str, **extra: str) -> Path:
    """A copy of reverse_words.yaml named ``task`` with raw YAML lines ``key: value`` appended."""
    text = (ASSET / "reverse_words.yaml").read_text().replace("task: reverse_words", f"task: {task}")
    text += "".join(f"{k}: {v}\n" for k, v in extra.items())
    p = folder / f"{task}.yaml"
    p.write_text(text)
    return p


def _specs(folder: Path, task: str, **eval_keys):
    """The `eval.benchmarks` of a config, validated as `trainpipe run` does it."""
    from trainpipe.config import build_config

    cfg = build_config({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
                        "eval": {"benchmarks": [{"task": task, "include_path": str(folder), "limit": 2}], **eval_keys}})
    return cfg.eval.benchmarks


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_sibling_yaml_s_function_never_runs(tmp_path, lm):
    from trainpipe.evaluate.benchmarks import run_benchmarks

    folder, marker = _task_folder(tmp_path), tmp_path / "PWNED"
    _evil_module(folder, "evil", marker)
    _task_with(folder, "aaa_unrelated", process_docs="!function evil.boom")  # sorts before reverse_words.yaml
    out = run_benchmarks(*lm, _specs(folder, "reverse_words"), batch_size=2)
    assert out["reverse_words"]["samples"] == 2
    assert not marker.exists(), "evil.py of an unrelated task YAML was imported"
    # a task whose file has another name is found by its `task:` key: the siblings are read as data, never loaded
    _task_with(folder, "renamed").rename(folder / "zz_file.yaml")
    (folder / "binary.yaml").write_bytes(b"\xff\xfe\x00task: renamed")
    out = run_benchmarks(*lm, _specs(folder, "renamed"), batch_size=2)
    assert out["renamed"]["samples"] == 2 and not marker.exists()


def test_a_task_s_own_function_is_refused_unless_allowed(tmp_path, lm):
    from trainpipe.evaluate.benchmarks import BenchmarkError, run_benchmarks

    folder, marker = _task_folder(tmp_path), tmp_path / "PWNED"
    _evil_module(folder, "helpers", marker)
    task_file = _task_with(folder, "with_code", process_docs="!function helpers.boom")
    with pytest.raises(BenchmarkError) as err:
        run_benchmarks(*lm, _specs(folder, "with_code"), batch_size=2)
    msg = err.value.message
    assert "\n" not in msg and str(task_file) in msg and "!function" in msg and "eval.allow_task_code: true" in msg
    assert not marker.exists()

    out = run_benchmarks(*lm, _specs(folder, "with_code", allow_task_code=True), batch_size=2)  # asked for: it runs
    assert out["with_code"]["samples"] == 2 and marker.read_text() == "called"


def test_a_task_file_named_by_its_path_or_included_is_checked_too(tmp_path, lm):
    """`include:` pulls a file that uses `!function`: refused; a task YAML named as `include_path` itself: loaded alone."""
    from trainpipe.evaluate.benchmarks import BenchmarkError, run_benchmarks

    folder, marker = _task_folder(tmp_path), tmp_path / "PWNED"
    _evil_module(folder, "helpers", marker)
    base = _task_with(folder, "base_with_code", process_docs="!function helpers.boom")
    (folder / "child.yaml").write_text(f"include: {base.name}\ntask: child\n")
    with pytest.raises(BenchmarkError, match="allow_task_code"):
        run_benchmarks(*lm, _specs(folder, "child"), batch_size=2)
    assert not marker.exists()
    out = run_benchmarks(*lm, _specs(folder / "reverse_words.yaml", "reverse_words"), batch_size=2)
    assert out["reverse_words"]["samples"] == 2 and not marker.exists()


def test_a_template_cannot_reach_python(tmp_path, lm):
    """lm-eval renders `doc_to_text` with an unsandboxed Jinja environment: a template could call os.system. Local tasks
    are rendered in Jinja's sandbox unless `eval.allow_task_code: true`."""
    from trainpipe.errors import TrainpipeError
    from trainpipe.evaluate.benchmarks import run_benchmarks

    folder, marker = _task_folder(tmp_path), tmp_path / "PWNED"
    payload = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}{{words}}"
    _task_with(folder, "ssti", doc_to_text=json.dumps(payload))
    with pytest.raises(TrainpipeError):
        run_benchmarks(*lm, _specs(folder, "ssti"), batch_size=2)
    assert not marker.exists()
    out = run_benchmarks(*lm, _specs(folder, "reverse_words"), batch_size=2)  # an ordinary template still renders
    assert out["reverse_words"]["samples"] == 2


# ----------------------------------------------------------------------------- names that reach a shell
def _config(folder: Path, **top) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "data" / "train.jsonl", alpaca_records(8))
    cfg = {"model": {"name_or_path": "sshleifer/tiny-gpt2"}, "data": {"sources": [{"path": "data/train.jsonl"}]},
           "distributed": {"nproc_per_node": 2, "nnodes": 1}, **top}
    p = folder / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("name", ["x\ntouch /tmp/pwned", "a;b", "$(id)", "-rf", "a b", "x" * 129])
def test_a_hostile_name_is_refused_by_config_validate(tmp_path, capsys, name):
    cfg = _config(tmp_path, name=name)
    assert main(["config", "validate", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "`name`" in out and "letters, digits" in out


@pytest.mark.parametrize("name", ["demo", "run-1.2_b", "A" * 128])
def test_a_plain_name_passes(tmp_path, name):
    assert main(["config", "validate", str(_config(tmp_path, name=name))]) == 0


def _stand_ins(bin_dir: Path, argv_file: Path) -> dict:
    """Stand-ins for the cluster's programs (none exists here): `torchrun` (the real one starts GPU workers) writes its
    argv as JSON; SLURM's `srun` writes the argv of the command it would run on every node (without srun's own options)
    the same way; `scontrol show hostnames` prints `n0`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    py = shutil.which("python3") or "/usr/bin/python3"
    progs = {
        "torchrun": f"#!{py}\nimport json, sys\nopen({str(argv_file)!r}, 'w').write(json.dumps(sys.argv[1:]))\n",
        "srun": f"#!{py}\nimport json, sys\nargs = sys.argv[1:]\nwhile args and args[0].startswith('--'):\n    args.pop(0)\n"
                f"open({str(argv_file)!r}, 'w').write(json.dumps(args))\n",
        "scontrol": "#!/usr/bin/env bash\necho n0\n",
    }
    for name, text in progs.items():
        f = bin_dir / name
        f.write_text(text)
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n0", "SLURM_JOB_ID": "1", "MASTER_ADDR": "n0"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash")
def test_every_value_in_the_torchrun_script_is_quoted(tmp_path, capsys):
    """A config path with a space and `$(...)`, and a `--set` value with shell syntax: the script parses (`bash -n`), its
    command line splits into exactly the intended argv, and running it (with the stand-in torchrun) runs nothing else."""
    marker = tmp_path / "PWNED"
    hostile = f"cfg dir $(touch {marker})"
    cfg = _config(tmp_path / hostile)
    out = tmp_path / "out $(touch x)`id`"
    sets = ["--set", f"tracking.experiment=a'b \"$(touch {marker})\" `id` ;x", "--set", "distributed.nnodes=1"]
    rc = main(["launch", str(cfg), "--emit", "torchrun", "-o", str(out), *sets])
    assert rc == 0, capsys.readouterr().out
    script = out / "launch-torchrun.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    line = next(x for x in script.read_text().splitlines() if x.startswith("exec torchrun"))
    argv = shlex.split(line)
    i = argv.index("-m")
    rel = os.path.relpath(cfg.resolve(), out.resolve())  # the script cds to its own folder: the config is named relative to it
    assert argv[i:] == ["-m", "trainpipe.cli", "run", rel, *sets, "$@"]

    got = tmp_path / "argv.json"
    env = _stand_ins(tmp_path / "bin", got)
    subprocess.run(["bash", str(script), "--resume"], check=True, env=env, cwd=tmp_path)
    ran = json.loads(got.read_text())
    assert ran[ran.index("-m"):] == ["-m", "trainpipe.cli", "run", rel, *sets, "--resume"]
    assert not marker.exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash")
@pytest.mark.parametrize("emit", ["torchrun", "slurm"])
def test_a_name_taken_from_a_hostile_file_name_is_made_safe(tmp_path, emit):
    """No `name` key: the run name comes from the file name, which validation never saw. The scripts carry a safe one,
    and running them (with the stand-ins) runs nothing but torchrun."""
    marker = tmp_path / "PWNED"
    cfg = _config(tmp_path / "c")
    evil = cfg.with_name("x\ntouch PWNED\n$(touch PWNED).yaml")  # the scripts run with tmp_path as the working directory
    cfg.rename(evil)
    assert main(["launch", str(evil), "--emit", emit, "-o", str(tmp_path / "out"), "--nnodes", "2"]) == 0
    script = next(p for p in (tmp_path / "out").iterdir() if p.name.startswith("launch"))
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    if emit == "slurm":
        job = next(x for x in text.splitlines() if x.startswith("#SBATCH --job-name="))
        assert re.fullmatch(r"#SBATCH --job-name=[A-Za-z0-9][A-Za-z0-9._-]*", job), job
    got = tmp_path / "argv.json"
    env = _stand_ins(tmp_path / "bin", got) | {"SLURM_SUBMIT_DIR": str(tmp_path / "out")}  # sbatch run from the script's folder
    subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, check=True)
    ran = json.loads(got.read_text())
    assert ran[ran.index("-m"):][:4] == ["-m", "trainpipe.cli", "run", os.path.relpath(evil.resolve(), (tmp_path / "out").resolve())]
    assert not marker.exists()


# ----------------------------------------------------------------------------- what `launch -o` may write
def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["run.yaml", "data/train.jsonl", "notes.txt"])
def test_launch_never_writes_over_the_config_its_data_or_a_user_file(tmp_path, capsys, target):
    cfg = _config(tmp_path / "p")
    (tmp_path / "p" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    rc = main(["launch", str(cfg), "--emit", "torchrun", "-o", str(tmp_path / "p" / target)])
    out = capsys.readouterr().out
    assert rc == 2 and "Nothing was written" in out and "Traceback" not in out
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("emit,name", [("torchrun", "launch-torchrun.sh"), ("slurm", "launch.sbatch"), ("k8s", "trainjob.yaml")])
def test_launch_replaces_only_its_own_unchanged_file(tmp_path, capsys, emit, name):
    cfg = _config(tmp_path / "p")
    out = tmp_path / "out"
    assert main(["launch", str(cfg), "--emit", emit, "-o", str(out)]) == 0
    first = (out / name).read_bytes()
    assert main(["launch", str(cfg), "--emit", emit, "-o", str(out), "--nproc-per-node", "4"]) == 0  # re-emit: fine
    assert (out / name).read_bytes() != first
    (out / name).write_text("# edited by hand\n")
    capsys.readouterr()
    assert main(["launch", str(cfg), "--emit", emit, "-o", str(out)]) == 2
    assert "Nothing was written" in capsys.readouterr().out and (out / name).read_text() == "# edited by hand\n"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / name).write_text("a user's own file\n")
    assert main(["launch", str(cfg), "--emit", emit, "-o", str(mine)]) == 2
    assert _tree(mine) == {name: b"a user's own file\n"}  # not even a manifest


def test_launch_files_are_redacted(tmp_path):
    cfg = _config(tmp_path / "p")
    out = tmp_path / "out"
    assert main(["launch", str(cfg), "-o", str(out), "--set", "tracking.uri=http://me:hunter2secret@mlflow:5000"]) == 0
    text = (out / "launch-torchrun.sh").read_text()
    assert "hunter2secret" not in text and "tracking.uri=http://me:***@mlflow:5000" in text


# ----------------------------------------------------------------------------- code the user names, said so
def test_the_options_that_run_code_say_so():
    from trainpipe.config import json_schema

    text = json.dumps(json_schema())
    assert text.count("runs Python code you name") >= 1 and "allow_task_code" in text
    props = json_schema()["$defs"]
    assert "runs Python code you name" in props["RLConfig"]["properties"]["reward_function"]["description"]
    assert "runs Python" in props["EvalConfig"]["properties"]["allow_task_code"]["description"]
    r = subprocess.run([os.sys.executable, "-m", "trainpipe.cli", "automl", "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "400"})
    assert "runs Python code you name" in " ".join(r.stdout.replace("\u2502", " ").split())
