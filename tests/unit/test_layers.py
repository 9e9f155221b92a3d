"""The layer rule of docs/architecture.md, measured on the real source with `ast` (every import, at module level or
inside a function).

Layers, bottom up (a module may import its own layer and those below, never one above):

    core < config < model, data < plan, distributed < evaluate, export, track, report < train < run
         < pipeline, launch < search (tune, automl, lr-find, batch-find) < cli

What is checked: no import goes up a layer; the import graph between trainpipe's modules has no circle (function-local
imports counted, so a lazy import cannot hide one); trainpipe's own imports are made at module level everywhere but
`cli/` (heavy third-party libraries such as torch stay lazy); no file over 600 lines; no function over 100 lines and
at most 5 over 80; no module-level registry that other code appends to or reassigns.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "trainpipe"

# module prefix -> layer (the longest matching prefix wins)
LAYERS = {
    "trainpipe": 0, "trainpipe.errors": 0, "trainpipe.events": 0, "trainpipe.ui": 0, "trainpipe.hashing": 0,
    "trainpipe.redact": 0, "trainpipe.faults": 0, "trainpipe.metrics": 0, "trainpipe.ownership": 0, "trainpipe._quiet": 0,
    "trainpipe.numbers": 0, "trainpipe.rundir": 0,
    "trainpipe.config": 1,
    "trainpipe.model": 2, "trainpipe.data": 2,
    "trainpipe.plan": 3, "trainpipe.distributed": 3,
    "trainpipe.evaluate": 4, "trainpipe.export": 4, "trainpipe.export_gguf": 4, "trainpipe.export_family": 4, "trainpipe.track": 4, "trainpipe.report": 4,
    "trainpipe.train": 5,
    "trainpipe.run": 6,
    "trainpipe.pipeline": 7, "trainpipe.launch": 7, "trainpipe.launch_files": 7, "trainpipe.launch_torchtitan": 7,
    "trainpipe.tune": 8,
    "trainpipe.cli": 9,
}
NAMES = {0: "core", 1: "config", 2: "model/data", 3: "plan/distributed", 4: "evaluate/export/track/report", 5: "train",
         6: "run", 7: "pipeline/launch", 8: "search", 9: "cli"}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _module_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=1)
def _files() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_of(f): (f, ast.parse(f.read_text(encoding="utf-8"), filename=str(f))) for f in sorted(SRC.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules) -> str | None:
    """The trainpipe module `name` refers to (`trainpipe.x.y` may name a function y of module trainpipe.x)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@lru_cache(maxsize=1)
def _imports() -> list[tuple[str, str, int, bool]]:
    """(importer, imported trainpipe module, line, at module level) for every internal import."""
    files = _files()
    out = []
    for mod, (path, tree) in files.items():
        is_pkg = path.name == "__init__.py"
        top = set(map(id, tree.body))
        guarded = {id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node, is_pkg)
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            else:
                continue
            at_top = id(node) in top or id(node) in guarded
            for t in targets:
                if not t.startswith("trainpipe"):
                    continue
                k = _known(t, files)
                if k and k != mod:
                    out.append((mod, k, node.lineno, at_top))
    return out


def _type_checking_only(mod: str, line: int) -> bool:
    path, tree = _files()[mod]
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
                return True
    return False


def test_no_import_goes_up_a_layer():
    up = [
        f"{a} ({NAMES[layer(a)]}) imports {b} ({NAMES[layer(b)]}) at line {n}"
        for a, b, n, _ in _imports()
        if layer(b) > layer(a) and not _type_checking_only(a, n)
    ]
    assert not up, f"{len(up)} upward imports:\n" + "\n".join(sorted(set(up)))


def test_the_import_graph_has_no_circle():
    graph: dict[str, set[str]] = {}
    for a, b, n, _ in _imports():
        if not _type_checking_only(a, n):
            graph.setdefault(a, set()).add(b)
    # a package's __init__ importing its own submodules is how a package exposes them, not a circle through it
    for a in list(graph):
        graph[a] = {b for b in graph[a] if not b.startswith(a + ".")}
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    import sys

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    assert not sccs, "import circles:\n" + "\n".join(" <-> ".join(c) for c in sccs)


def test_internal_imports_are_at_module_level_outside_cli():
    local = sorted({f"{a}:{n} imports {b}" for a, b, n, top in _imports() if not top and layer(a) < LAYERS["trainpipe.cli"]})
    assert not local, f"{len(local)} function-local trainpipe imports outside cli/:\n" + "\n".join(local)


def test_no_file_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p, _ in _files().values() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long


def _functions():
    for mod, (path, tree) in _files().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(SRC)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


def test_no_function_over_100_lines_and_at_most_5_over_80():
    sizes = dict(_functions())
    over_100 = {k: v for k, v in sizes.items() if v > 100}
    over_80 = {k: v for k, v in sizes.items() if v > 80}
    assert not over_100, over_100
    assert len(over_80) <= 5, over_80


def test_no_module_level_mutable_registry():
    """A module-level list/dict/set that code elsewhere appends to, or a module attribute other code reassigns
    (`tracking.REGISTER_AT_END = False`), is global state a caller must remember to undo: pass it in instead."""
    files = _files()
    registries = {}
    for mod, (_, tree) in files.items():
        for stmt in tree.body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(stmt.value, (ast.List, ast.Dict, ast.Set)):
                for t in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    if isinstance(t, ast.Name):
                        registries[t.id] = mod
    mutators = {"append", "remove", "extend", "insert", "pop", "clear", "add", "discard", "update", "setdefault"}
    found = []
    for mod, (path, tree) in files.items():
        for node in ast.walk(tree):
            # NAME.append(...) on a module-level container, from a function (import-time set-up in the module itself is fine)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in mutators):
                        target = sub.func.value
                        name = target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) else None
                        local = {a.arg for a in node.args.args + node.args.kwonlyargs} | {
                            t.id for s in ast.walk(node) if isinstance(s, (ast.Assign, ast.AnnAssign, ast.For, ast.With))
                            for t in ast.walk(s.targets[0] if isinstance(s, ast.Assign) else s.target if not isinstance(s, ast.With) else s)
                            if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
                        if name in registries and name.isupper() and name not in local:
                            found.append(f"{path.relative_to(SRC)}:{sub.lineno} {name}.{sub.func.attr}() ({registries[name]})")
                    if isinstance(sub, ast.Global):
                        found.append(f"{path.relative_to(SRC)}:{sub.lineno} global {', '.join(sub.names)}")
            # module.ATTR = ... from anywhere
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.attr.isupper():
                        found.append(f"{path.relative_to(SRC)}:{node.lineno} {t.value.id}.{t.attr} = ...")
    assert not found, "module-level mutable state:\n" + "\n".join(sorted(set(found)))
