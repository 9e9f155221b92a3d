"""Every runtime dependency in pyproject.toml is one trainpipe's own code imports (issue 14 item 9).

A package listed under `[project] dependencies` that nothing in `src/` imports is weight a user installs for
nothing (and a version conflict waiting to happen). Both sides are read from the real files: pyproject.toml with
tomllib, the imports with `ast` (every `import x` / `from x import y`, at any depth, lazy ones included), and
the distribution -> module names from the installed metadata (`packages_distributions`)."""

from __future__ import annotations

import ast
import re
import tomllib
from functools import lru_cache
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "trainpipe"


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def _imported_modules() -> dict[str, set[str]]:
    """Top-level module name -> the files of src/trainpipe that import it."""
    out: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                out.setdefault(n.split(".")[0], set()).add(str(f.relative_to(REPO)))
    return out


@lru_cache(maxsize=None)
def _modules_of(dist: str) -> frozenset[str]:
    """The top-level import names the installed distribution `dist` provides (yaml for pyyaml, ...)."""
    mods = {m for m, dists in _distributions().items() if dist in {d.lower().replace("_", "-") for d in dists}}
    return frozenset({m for m in mods if not m.startswith("_")} or {dist.replace("-", "_")})


@lru_cache(maxsize=1)
def _distributions() -> dict:
    return packages_distributions()


def test_every_runtime_dependency_is_imported_by_src():
    deps = [_dist_name(r) for r in _pyproject()["project"]["dependencies"]]
    assert deps, "pyproject.toml lists no runtime dependencies"
    imported = _imported_modules()
    unused = {d: sorted(_modules_of(d)) for d in deps if not (_modules_of(d) & set(imported))}
    assert not unused, (
        f"runtime dependencies that no file under src/ imports: {unused}. Import what trainpipe depends on, or move the "
        "package to the optional extra (or the dev extra) that needs it."
    )


def test_trl_and_accelerate_decision_holds():
    """trl and accelerate are not runtime dependencies while nothing in src/ imports them; the tests that compare
    trainpipe's losses with TRL's trainers get trl from the dev extra."""
    project = _pyproject()["project"]
    runtime = {_dist_name(r) for r in project["dependencies"]}
    imported = _imported_modules()
    for dist, module in (("trl", "trl"), ("accelerate", "accelerate")):
        assert (dist in runtime) == (module in imported), f"{dist}: runtime dependency {dist in runtime}, imported by src/ {module in imported}"
    assert "trl" in {_dist_name(r) for r in project["optional-dependencies"]["dev"]}
