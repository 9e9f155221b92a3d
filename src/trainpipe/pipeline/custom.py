"""Steps of one's own in the pipeline DAG (`pipeline.steps:`, config/steps.py): a Python function or a command.

A custom step is a `Step` of kind `custom` beside the built-in ones (dag.py): its inputs are files and folders outside
the DAG (`path:`) or other steps' outputs (`from: step.output`, a built-in step's too), its outputs are declared `file`
or `folder`. Its cache key (cache.py) is the content of its inputs, its parameters and command, and its code: a function's
source read with `ast` (with the helpers of its file it calls and the file's imports and constants), a command's script
(its first `.py` argument), and the files listed in `code:`, so editing one step's code reruns that step and the steps
downstream of it only.

It runs in its own process (`python -m trainpipe.pipeline.invoke` for a function; the command as an argv list, no shell),
in the config file's folder, given one scratch path per output; `retries` failed attempts are tried again. Then the
ownership rule for its outputs: every declared output must exist, and nothing outside its outputs may have changed (the
config's folder and its inputs are compared, file by file, before and after): otherwise one paragraph, exit 2, and
nothing of that run is kept. Its outputs go to the artefact store (the cache) and are published under
`<output_dir>/<step>/` through the ownership rule.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.config import RunConfig
from trainpipe.config.steps import CustomStepConfig
from trainpipe.pipeline.steps import PipelineError
from trainpipe.pipeline.store import ArtifactStore

RUNNER = "trainpipe custom step runner 1"  # part of every custom step's code hash: how a step is called
MAX_WATCHED = 50_000  # files of the config's folder compared before and after a step


class CustomStep:
    """Mixed into dag.Step (dag.py builds `CustomDagStep`): the declared interface of a step of one's own."""

    spec: CustomStepConfig
    base: Path

    @property
    def outputs(self) -> dict[str, str]:
        return dict(self.spec.outputs)

    @property
    def input_types(self) -> dict[str, str]:
        return {n: i.type for n, i in self.spec.inputs.items()}

    def config_section(self) -> dict:
        s = self.spec
        return {"function": s.function, "command": s.command, "params": s.params, "outputs": s.outputs, "env": s.env,
                "inputs": {n: {"type": i.type, "from": i.from_} for n, i in s.inputs.items()}}

    def path_inputs(self) -> dict[str, Path]:
        return {n: (self.base / i.path).resolve() for n, i in self.spec.inputs.items() if i.path is not None}


# --------------------------------------------------------------------------- building


def link_custom(cfg: RunConfig, builtin: list, make) -> list:
    """The DAG's steps: the built-in ones, then the custom ones in an order that runs each after its inputs. ``make(spec)``
    builds a step object. A cycle, a duplicate name, an unknown `from:` or a type that does not fit: one paragraph."""
    specs = cfg.pipeline.steps
    ids = {s.id for s in builtin}
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.name in ids or spec.name in seen:
            raise PipelineError(f"`pipeline.steps[{i}].name: {spec.name}` is the name of another step of the DAG ({', '.join(sorted(ids | seen))}); "
                                "give each step its own name.")
        seen.add(spec.name)
    steps = {s.id: s for s in builtin}
    custom = {spec.name: make(spec) for spec in specs}
    everything = {**steps, **custom}
    for i, spec in enumerate(specs):
        step = custom[spec.name]
        for name, inp in spec.inputs.items():
            if inp.from_ is None:
                continue
            src, _, out = inp.from_.rpartition(".")
            where = f"`pipeline.steps[{i}].inputs.{name}.from: {inp.from_}`"
            if src not in everything:
                raise PipelineError(f"{where} names no step of the DAG; the steps are {', '.join(everything)}. Fix the step name.")
            outs = everything[src].outputs
            if out not in outs:
                raise PipelineError(f"{where}: step `{src}` has no output `{out}`; its outputs are {', '.join(outs)}.")
            got = outs[out] if outs[out] in ("file", "folder") else "folder"  # a built-in output (RunDir, Model, ...) is a folder
            if inp.type != "any" and inp.type != got:
                raise PipelineError(f"{where}: the input is declared `type: {inp.type}` and `{src}.{out}` is a {got}; make them agree.")
            step.inputs[name] = (src, out)
    for s in builtin:  # `pipeline.data_from`: a built-in step reading a custom step's output
        for name, (src, out) in s.inputs.items():
            if src not in everything or out not in everything[src].outputs:
                raise PipelineError(f"`pipeline.data_from: {src}.{out}` names no output of `pipeline.steps`; the steps are "
                                    f"{', '.join(custom)}. Name a folder output as `step.output`.")
    return _ordered(everything)


def _ordered(steps: dict) -> list:
    """Every step after the steps it reads (the built-in order kept where nothing forces another); a cycle: one paragraph."""
    order: list = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = path[path.index(name):] + [name]
            raise PipelineError(f"The steps of `pipeline.steps` form a cycle: {' -> '.join(cycle)} (each reads an output of the next "
                                "through `inputs.*.from`). A pipeline is a DAG: remove one of these `from:` links.")
        state[name] = 1
        for src, _ in steps[name].inputs.values():
            visit(src, path + [name])
        state[name] = 2
        order.append(steps[name])

    for name in steps:
        visit(name, [])
    return order


def check_paths(steps: list) -> None:
    """Every `path:` input exists and every function's file does (`pipeline run`), before any step runs."""
    problems = []
    for i, s in enumerate(x for x in steps if isinstance(x, CustomStep)):
        for name, p in s.path_inputs().items():
            if not p.exists():
                problems.append(f"`pipeline.steps[{i}].inputs.{name}.path`: {p} does not exist")
        if s.spec.function and not (s.base / s.spec.function.split(":")[0]).is_file():
            problems.append(f"`pipeline.steps[{i}].function: {s.spec.function}`: no file {s.base / s.spec.function.split(':')[0]}")
    if problems:
        raise PipelineError("The pipeline's own steps name files that are not there: " + "; ".join(problems) + ". Fix the paths (relative to the config file).")


# --------------------------------------------------------------------------- the step's code


def function_source(file: Path, name: str) -> str:
    """The source of `name` in `file`, the top-level functions and classes of the file it uses (transitively), and the
    file's imports and constants: what decides what the function does, read with `ast` (nothing imported)."""
    text = file.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(file))
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    if name not in defs:
        raise PipelineError(f"`{file.name}` has no top-level function `{name}`; it defines {', '.join(defs) or 'none'}.")
    keep, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in keep:
            continue
        keep.add(n)
        todo += [x.id for x in ast.walk(defs[n]) if isinstance(x, ast.Name) and x.id in defs]
    rest = [ast.get_source_segment(text, n) or "" for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "\n".join(rest + [ast.get_source_segment(text, defs[n]) or "" for n in sorted(keep)])


def script_of(step: CustomStep) -> Path | None:
    """A command's script: its first argument ending in `.py` that is a file (relative to the config's folder)."""
    for tok in shlex.split(step.spec.command or ""):
        if tok.endswith(".py") and (step.base / tok).is_file():
            return (step.base / tok).resolve()
    return None


def custom_code_hash(step: CustomStep) -> str:
    h = hashlib.sha256(RUNNER.encode() + b"\0")
    if step.spec.function:
        file, name = step.spec.function.split(":")
        h.update(b"function\0" + function_source(step.base / file, name).encode() + b"\0")
    else:
        script = script_of(step)
        h.update(b"command\0" + (script.read_bytes() if script else b"") + b"\0")
    for rel in sorted(step.spec.code):
        p = step.base / rel
        files = sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts) if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(step.base)).encode() + b"\0" + (f.read_bytes() if f.is_file() else b"<missing>") + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- running


def _snapshot(roots: list[Path], skip: list[Path]) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `roots` (hidden folders, `__pycache__` and `skip` left out)."""
    out: dict[str, tuple[int, int]] = {}
    skip_s = {str(p) for p in skip}
    for root in roots:
        if root.is_file():
            st = root.stat()
            out[str(root)] = (st.st_size, st.st_mtime_ns)
            continue
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__" and os.path.join(d, x) not in skip_s]
            for f in files:
                p = os.path.join(d, f)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                out[p] = (st.st_size, st.st_mtime_ns)
                if len(out) > MAX_WATCHED:
                    return out
    return out


def _argv(step: CustomStep, ins: dict[str, Path], outs: dict[str, Path], spec_file: Path) -> list[str]:
    if step.spec.function:
        return [sys.executable, "-m", "trainpipe.pipeline.invoke", str(spec_file)]
    values = {**{f"inputs.{k}": str(v) for k, v in ins.items()}, **{f"outputs.{k}": str(v) for k, v in outs.items()},
              **{f"params.{k}": (json.dumps(v) if isinstance(v, (dict, list)) else str(v)) for k, v in step.spec.params.items()}}

    def fill(tok: str) -> str:
        for k, v in values.items():
            tok = tok.replace("{" + k + "}", v)
        if "{inputs." in tok or "{outputs." in tok or "{params." in tok:
            raise PipelineError(f"step `{step.id}`: `{tok}` in its command names an input, output or parameter the step does not declare.")
        return tok

    argv = [fill(t) for t in shlex.split(step.spec.command)]
    if argv and argv[0] in ("python", "python3"):  # the interpreter trainpipe runs under (its venv)
        argv[0] = sys.executable
    return argv


def run_custom(step, entries: dict, st: ArtifactStore, work: Path, *, local_input, root: Path, store_path: Path | None) -> dict[str, Path]:
    """Run the step (with its retries); its outputs (name -> local path), checked by the ownership rule."""
    con = ui.console()
    ins = {name: local_input(entries, src, out, st, work) for name, (src, out) in step.inputs.items()} | step.path_inputs()
    outs_dir = work / "outputs"
    outs = {n: outs_dir / n for n in step.spec.outputs}
    spec_file = work / "call.json"
    skip = [root, work] + ([store_path] if store_path else [])
    for attempt in range(step.spec.retries + 1):
        ownership_clear(outs_dir, outs, step)
        spec_file.write_text(json.dumps({"function": step.spec.function, "base": str(step.base), "inputs": {k: str(v) for k, v in ins.items()},
                                         "outputs": {k: str(v) for k, v in outs.items()}, "params": step.spec.params}), encoding="utf-8")
        argv = _argv(step, ins, outs, spec_file)
        watched = [step.base] + [p for p in ins.values() if not p.is_relative_to(step.base)]
        before = _snapshot(watched, skip)
        env = {**os.environ, **step.spec.env, "PYTHONDONTWRITEBYTECODE": "1", "TRAINPIPE_STEP": step.id}
        p = subprocess.run(argv, cwd=step.base, env=env, capture_output=True, text=True)
        after = _snapshot(watched, skip)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if changed:
            raise PipelineError(
                f"Step `{step.id}` wrote outside its output folder: {', '.join(f'`{c}`' for c in changed[:5])}"
                f"{f' and {len(changed) - 5} more' if len(changed) > 5 else ''} changed, appeared or went away while it ran. A step "
                f"writes only into the paths it is given for its outputs ({', '.join(f'{{outputs.{n}}}' for n in outs)}); fix its code. "
                "Nothing of this run of the step was kept in the cache, and the files it changed were left as they are.")
        if p.stdout.strip():
            con.print(p.stdout.rstrip(), markup=False, highlight=False, soft_wrap=True)
        if p.returncode == 0:
            break
        tail = (p.stderr or p.stdout).strip()[-1500:]
        if attempt < step.spec.retries:
            con.print(f"  {step.id}: exit {p.returncode}, trying again ({attempt + 1} of {step.spec.retries} retries)", markup=False)
            continue
        raise PipelineError(f"Step `{step.id}` failed (exit {p.returncode}) after {attempt + 1} attempt(s): `{shlex.join(argv)}` in {step.base}. "
                            f"Its last output: {tail or '(none)'}. Nothing of it was kept; the steps before it stay cached.")
    missing = [n for n, kind in step.spec.outputs.items() if not (outs[n].is_file() if kind == "file" else outs[n].is_dir())]
    if missing:
        raise PipelineError(
            f"Step `{step.id}` finished without its declared output(s) {', '.join(f'`{m}` ({step.spec.outputs[m]}, `{{outputs.{m}}}`)' for m in missing)}: "
            "it must write each output to the path it is given. Nothing of this run of the step was kept in the cache.")
    return outs


def ownership_clear(outs_dir: Path, outs: dict[str, Path], step) -> None:
    """The scratch outputs, fresh for each attempt: folders created, files left for the step to create."""
    import shutil

    shutil.rmtree(outs_dir, ignore_errors=True)  # scratch under the step's own temporary folder
    outs_dir.mkdir(parents=True)
    for n, kind in step.spec.outputs.items():
        if kind == "folder":
            outs[n].mkdir()


def steps_root(cfg: RunConfig) -> Path:
    """Where custom steps' outputs are published: `<output_dir>/` when only they run (`pipeline.builtin: false`), else
    `<output_dir>.steps/` beside the built-in chain's run folder (which must never hold a run's inputs)."""
    out = Path(cfg.output_dir).resolve()
    return out if not cfg.pipeline.builtin else out.with_name(out.name + ".steps")


def publish(step, entry: dict, st: ArtifactStore, root: Path) -> Path:
    """The step's outputs under `<root>/<step>/` (`steps_root`; replaced only when every entry there is trainpipe's)."""
    dest = root / step.id
    try:
        if json.loads((dest / "step.json").read_text(encoding="utf-8"))["key"] == entry["key"]:
            return dest
    except (OSError, ValueError, KeyError):
        pass

    def build(tmp: Path) -> None:
        for name, o in entry["outputs"].items():
            st.materialize(o["key"], tmp / name)
        (tmp / "step.json").write_text(json.dumps({"step": step.id, "key": entry["key"], "outputs": {n: o["uri"] for n, o in entry["outputs"].items()}},
                                                  indent=2), encoding="utf-8")

    ownership.make_dir(root, what="the folder of the pipeline steps' outputs")
    return ownership.replace_dir(dest, build, what=f"the published outputs of step `{step.id}`")
