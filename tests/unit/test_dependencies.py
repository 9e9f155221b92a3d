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


def _constraints() -> dict[str, str]:
    pins = {}
    for n, line in enumerate((REPO / "scripts" / "constraints.txt").read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)", line.strip())
        assert m, f"scripts/constraints.txt line {n} is not `name==version`: {line!r}"
        pins[m.group(1).lower().replace("_", "-").replace(".", "-")] = m.group(2)
    return pins


def test_constraints_pin_every_direct_dependency_within_its_floor():
    """scripts/constraints.txt (what bootstrap.sh installs under) pins every package pyproject names for the core and
    the dev extra (torch aside: bootstrap.sh pins it), each at a version pyproject's own floor accepts. A dependency
    added to pyproject without refreshing the lock (scripts/lock.sh) fails here, not on a fresh machine."""
    from packaging.requirements import Requirement

    pins = _constraints()
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    problems = []
    for r in reqs:
        name = r.name.lower().replace("_", "-").replace(".", "-")
        if name == "torch":
            assert name not in pins, "torch is pinned by scripts/bootstrap.sh (CPU or CUDA build), not by constraints.txt"
            continue
        if name not in pins:
            problems.append(f"{r.name}: not pinned")
        elif not r.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{r.name}: pinned {pins[name]} outside pyproject's `{r.specifier}`")
    assert not problems, problems
