"""Every place in trainpipe that writes, replaces or deletes a file without going through `ownership.py` is listed here,
with the reason it may: the rule is structural only if a new writer cannot slip in unnoticed.

The test reads every source file with `ast` and finds the calls that touch the file system directly
(`Path.write_text/write_bytes/unlink/rmdir/rename/touch`, `open(..., "w"|"a"|"x"|"+")`, `os.replace/remove/unlink/rename`,
`shutil.rmtree/copyfile/copy2/copytree/move`, `torch.save`, `save_pretrained`, safetensors' `save_file`). Calls on
`ownership.` itself are the rule and are not listed. A function that writes directly and is not in ALLOWED fails the test:
route it through `ownership.write_text/write_json/write_bytes/replace_dir/remove` (or `track.manifest.write_json`), or,
when it writes only inside a folder the ownership rule already claimed for this command, add it here with that reason.
A listed function that no longer writes directly also fails, so the list cannot rot.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "trainpipe"

PATH_ATTRS = {"write_text", "write_bytes", "unlink", "rmdir", "rename", "touch", "symlink_to", "hardlink_to", "save_pretrained", "save_file"}
MODULE_CALLS = {("os", "replace"), ("os", "remove"), ("os", "unlink"), ("os", "rename"), ("shutil", "rmtree"), ("shutil", "copyfile"),
                ("shutil", "copy2"), ("shutil", "copytree"), ("shutil", "move"), ("torch", "save")}

# Inside a folder the command claimed through the ownership rule (the run folder: rundir.claim / ownership.claim_dir;
# a store or cache root: ownership.make_dir; a temporary folder of its own that ownership.replace_dir moves into place).
RUN_FOLDER = "inside the run folder the run claimed through the ownership rule (rundir.py), in files only trainpipe names"
STORE = "inside the pipeline store, whose entries its own manifest fingerprints (pipeline/store.py, ownership.make_dir)"
CACHE = "inside the dataset cache's own temporary entry, committed by an atomic rename (data/cache.py)"
STAGING = "into a temporary folder of its own that ownership.replace_dir / claim_dir moves into place"
ALLOWED: dict[str, dict[str, str]] = {
    "data/build.py": {"_pack_split": CACHE, "write": CACHE},
    "data/cache.py": {"_drop_empty_manifest": CACHE, "abort": CACHE, "commit": CACHE, "write_json": CACHE},
    "data/commands.py": {"run_prepare": "copies the prepared split into the output folder `data prepare` claimed (ownership.make_dir)"},
    "data/intake.py": {"read_all": "a spill file in a private tempfile.TemporaryDirectory, removed with it"},
    "data/prepare.py": {"prepare": "the report and rejected records into the folder its caller claimed (the run folder, `data prepare`'s output folder, a pipeline step's work folder)"},
    "distributed/ddp.py": {"_fire": "the hang watchdog's heartbeat/verdict files in the run folder's own `.trainpipe/` area"},
    "distributed/env.py": {"silence_console": "opens os.devnull for writing (no file is written)"},
    "evaluate/gates.py": {"mark_model": STAGING + " (the exported model's card, redacted)", "write_review_samples": RUN_FOLDER + " (redacted)"},
    "events.py": {"append_line": RUN_FOLDER + " (events.jsonl and metrics.jsonl, appended one whole line at a time; events redacted)"},
    "export.py": {"_move_into": STAGING, "_replace": STAGING, "_write": STAGING, "save_tokenizer": STAGING, "export_folder": STAGING, "export_model": STAGING},
    "export_family.py": {"export_supervised": STAGING, "write_beside": STAGING + " (a run's sealed `model/` rebuilt between rundir.begin and rundir.seal)"},
    "export_gguf.py": {"write_gguf": "a temporary file beside the GGUF path checked by ownership.check_writable, then renamed"},
    "model/checkpoints.py": {"_guarded.run": RUN_FOLDER, "interop_writer.write": RUN_FOLDER, "interop_writer.write_full": RUN_FOLDER,
                             "rotate": RUN_FOLDER + " (only `checkpoint-N` folders whose manifest names this run)", "save": RUN_FOLDER,
                             "_remove_checkpoint": RUN_FOLDER + " (rotation: only the files a checkpoint's own manifest lists; anything else stays)"},
    "pipeline/cache.py": {"_drop": STORE},
    "pipeline/dag.py": {"_run_step": STORE + " (a step's private work folder)"},
    "pipeline/custom.py": {"run_custom": STORE + " (a step's private work folder: its call file)", "ownership_clear": STORE + " (a step's private work folder: its scratch outputs)",
                           "publish.build": "the temporary folder of ownership.replace_dir, sealed by it before it replaces the published outputs"},
    "pipeline/export_run.py": {"export_adapters": STAGING},
    "pipeline/schedule.py": {"emit_kfp_recurring_run": "a private tempfile folder for kfp's compiler; the files it emits go through ownership.write_text"},
    "pipeline/steps.py": {"_step_evaluate": STORE + " (a step's private work folder)", "_step_export": STORE + " (a step's private work folder)",
                          "_step_register": STORE + " (a step's private work folder, redacted)", "_step_report": STORE + " (a step's private work folder)"},
    "pipeline/store.py": {"_move": STORE, "_open": STORE, "_prune": STORE, "materialize": STORE, "remove_listed": STORE + " (only entries its manifest lists)"},
    "rundir.py": {"acquire": "the run folder's lock file, its own", "drop_manifest_tmp": "the ownership manifest's own temporary file",
                  "release": "the run folder's lock file, its own", "write_marker": "the run marker inside the claimed run folder"},
    "train/classify.py": {"export_classifier": STAGING},
    "train/image.py": {"export_image_model": STAGING},
    "train/preemption.py": {"_run": "the preemption notice file inside the run folder (.trainpipe/)"},
    "train/pretrain.py": {"save_export_base": STAGING},
    "train/reward.py": {"export_reward_model": STAGING},
    "tune/automl.py": {"event_log.log": "the study's events.jsonl inside the output folder automl claimed (ownership.claim_dir), appended, redacted"},
    "tune/automl_outputs.py": {"carry_checkpoints": STAGING, "carry_checkpoints.build": STAGING, "export_winner.build": STAGING},
    "tune/automl_tabular.py": {"finish.build": STAGING + " (the AutoML winner: AutoGluon's predictor and its description, or trainpipe's exported model)"},
    "tune/tune.py": {"finish": STAGING},
}


def _writes(tree: ast.AST) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    stack: list[str] = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.append(node.name)
            for child in ast.iter_child_nodes(node):
                visit(child)
            stack.pop()
            return
        if isinstance(node, ast.Call):
            what = _direct_write(node)
            if what:
                found.setdefault(".".join(stack) or "<module>", []).append(f"{what} (line {node.lineno})")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _mode(node: ast.Call, index: int):
    if len(node.args) > index:
        return node.args[index]
    return next((k.value for k in node.keywords if k.arg == "mode"), None)


def _direct_write(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Attribute):
        base = ast.unparse(f.value)
        if base == "ownership":
            return None
        if (base, f.attr) in MODULE_CALLS:
            return f"{base}.{f.attr}"
        if base in ("os", "shutil", "torch"):
            return None
        if f.attr in PATH_ATTRS:
            return f.attr
        if f.attr == "open":
            mode = _mode(node, 0)
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                return f".open({mode.value!r})"
    if isinstance(f, ast.Name) and f.id == "open":
        mode = _mode(node, 1)
        if mode is not None and not isinstance(mode, ast.Constant):
            return "open(<computed mode>)"
        if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
            return f"open({mode.value!r})"
    return None


def _all_writes() -> dict[str, dict[str, list[str]]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "ownership.py":
            continue
        found = _writes(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            out[rel] = found
    return out


def test_every_direct_file_write_is_listed_with_its_reason():
    unlisted = [f"{rel}:{fn}: {', '.join(calls)}" for rel, fns in _all_writes().items() for fn, calls in fns.items()
                if fn not in ALLOWED.get(rel, {})]
    assert not unlisted, ("these functions write, replace or delete files without the ownership rule; route them through "
                          "ownership.py or list them in ALLOWED with the reason they may:\n" + "\n".join(unlisted))


def test_the_list_has_no_stale_entry():
    writes = _all_writes()
    stale = [f"{rel}:{fn}" for rel, fns in ALLOWED.items() for fn in fns if fn not in writes.get(rel, {})]
    assert not stale, "listed as writing directly but no longer does (remove from ALLOWED): " + ", ".join(stale)


def test_the_scan_finds_a_direct_write():
    probe = ast.parse("def leak(p):\n    p.write_text('x')\n\ndef fine(p):\n    ownership.write_text(p, 'x', what='w')\n"
                      "def also(p):\n    with open(p, 'a') as f:\n        f.write('x')\n    shutil.rmtree(p)\n")
    found = _writes(probe)
    assert set(found) == {"leak", "also"} and len(found["also"]) == 2
