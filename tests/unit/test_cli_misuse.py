"""Every misuse of the `trainpipe` command is a usage message and exit code 2, never a traceback.

The commands are walked in the Typer app at test time, so a command added later is covered too: for each one an
unknown option, a missing argument, a value of the wrong type (every int/float/choice option); for each group an
unknown sub-command and no sub-command at all. A few cases also go through a real `python -m trainpipe.cli`
process, whose exit status is the one a shell sees.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer

from trainpipe.cli import app, main


def _walk(cmd, path=()):
    yield path, cmd
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(None):
            yield from _walk(cmd.get_command(None, name), (*path, name))


ROOT = typer.main.get_command(app)
ALL = list(_walk(ROOT))
COMMANDS = [(p, c) for p, c in ALL if p and not hasattr(c, "list_commands")]
GROUPS = [(p, c) for p, c in ALL if hasattr(c, "list_commands")]


def _ids(items):
    return [" ".join(p) or "trainpipe" for p, _ in items]


def _required_args(cmd, existing_file: str) -> list[str]:
    return [existing_file for prm in cmd.params if prm.param_type_name == "argument" and prm.required]


def _misuse(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    rc = main(argv)
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert rc == 2, f"trainpipe {' '.join(argv)} exited {rc}:\n{out}"
    assert "Traceback" not in out, out
    assert "Usage:" in out, f"no usage message for trainpipe {' '.join(argv)}:\n{out}"
    return out


def test_the_walk_sees_the_commands():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"run", "plan", "diagnose", "export", "data inspect", "data prepare", "config validate"} <= names
    assert {("data",), ("config",), ()} <= {p for p, _ in GROUPS}


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=_ids(COMMANDS))
def test_unknown_option(capsys, tmp_path, path, cmd):
    f = tmp_path / "x.yaml"
    f.write_text("{}\n")
    out = _misuse(capsys, [*path, *_required_args(cmd, str(f)), "--no-such-option-zz"])
    assert "--no-such-option-zz" in out


@pytest.mark.parametrize("path,cmd", [(p, c) for p, c in COMMANDS if any(x.param_type_name == "argument" and x.required for x in c.params)],
                         ids=_ids([(p, c) for p, c in COMMANDS if any(x.param_type_name == "argument" and x.required for x in c.params)]))
def test_missing_argument(capsys, path, cmd):
    out = _misuse(capsys, list(path))
    assert "Missing argument" in out


def _base_type(ann):
    """int / float / an Enum or Literal (a choice) inside Optional[...] or list[...]; else None."""
    import enum
    import typing

    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        return "choice"
    if args and typing.get_origin(ann) is not None:
        return _base_type(args[0])
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return "choice"
    if ann is int or ann is float:
        return ann.__name__
    return None


def _typed_options(cmd):
    """(flag, bad value) for every option that takes an int, a float or a choice."""
    out = []
    for prm in cmd.params:
        if prm.param_type_name != "option" or getattr(prm, "is_flag", False) or not prm.opts:
            continue
        kind = _base_type(prm.type_descriptor.annotation)
        if kind == "choice":
            out.append((prm.opts[0], "not-a-choice-zz"))
        elif kind in ("int", "float"):
            out.append((prm.opts[0], "not-a-number"))
    return out


TYPED = [(p, c, flag, bad) for p, c in COMMANDS for flag, bad in _typed_options(c)]


def test_typed_options_are_found():
    flags = {(" ".join(p), f) for p, _, f, _ in TYPED}
    assert ("plan", "--num-gpus") in flags and ("plan", "--budget-usd") in flags and ("data inspect", "-n") in flags


@pytest.mark.parametrize("path,cmd,flag,bad", TYPED, ids=[f"{' '.join(p)} {f}" for p, _, f, _ in TYPED])
def test_bad_value_type(capsys, tmp_path, path, cmd, flag, bad):
    f = tmp_path / "x.yaml"
    f.write_text("{}\n")
    out = _misuse(capsys, [*path, *_required_args(cmd, str(f)), flag, bad])
    assert "Invalid value" in out and flag in out


@pytest.mark.parametrize("path,group", GROUPS, ids=_ids(GROUPS))
def test_unknown_subcommand_names_what_exists(capsys, path, group):
    out = _misuse(capsys, [*path, "no-such-command-zz"])
    assert "No such command 'no-such-command-zz'" in out
    for name in group.list_commands(None):
        assert name in out  # the message lists the commands that do exist


@pytest.mark.parametrize("path,group", [g for g in GROUPS if g[0]], ids=_ids([g for g in GROUPS if g[0]]))
def test_group_without_subcommand_shows_its_help(capsys, path, group):
    out = _misuse(capsys, list(path))
    for name in group.list_commands(None):
        assert name in out


def test_data_help_lists_only_what_exists(capsys):
    assert main(["data", "--help"]) == 0
    out = capsys.readouterr().out
    data = ROOT.get_command(None, "data")
    assert "prepare" in data.list_commands(None) and "inspect" in data.list_commands(None)
    assert "prepare" in out and "inspect" in out


@pytest.mark.parametrize("argv", [["tune"], ["data", "prepare"], ["run", "--bogus"], ["plan", "--num-gpus", "abc"], ["export"]])
def test_real_process_exit_code(argv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRAINPIPE_TEST_FAULTS"}
    p = subprocess.run([sys.executable, "-m", "trainpipe.cli", *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "Traceback" not in out and "Usage:" in out


@pytest.mark.parametrize("argv,key", [(["plan", "--model", "m", "--method", "lora"], "--set method.peft=VALUE"),
                                      (["plan", "--model", "m", "--seq-len", "512"], "--set data.max_length=VALUE"),
                                      (["automl", "-o", "out"], "--set automl.output_dir=VALUE")])
def test_a_flag_that_became_a_config_key_names_it(capsys, argv, key):
    """Issue 23: `plan --model` and `automl` take the settings that duplicated config keys through `--set`; the old flag
    is a usage error (exit 2) that names the key."""
    assert main(argv) == 2
    assert key in " ".join(capsys.readouterr().err.replace("\u2502", " ").split())


def test_the_one_prepare_command(capsys):
    """`trainpipe prepare` was a second name of `trainpipe data prepare`: gone, and the usage error names the one left."""
    assert main(["prepare", "x.yaml"]) == 2
    assert "trainpipe data prepare CONFIG" in " ".join(capsys.readouterr().err.replace("\u2502", " ").split())
