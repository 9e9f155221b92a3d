"""The docs a newcomer reads: a short README, the reference in docs/, the config reference generated from the config
models (CI fails here when it is stale), links that stay inside the repository, and no test file names or internal
issue numbers in user prose."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = ("config", "methods", "data", "run-directory", "planner", "evaluation", "resilience", "distributed", "search",
         "tracking-and-pipelines", "security", "architecture", "testing", "install")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<a\s[^>]*href=\"([^\"]+)\"", re.I)
TEST_FILE = re.compile(r"\btests/[\w./-]*\.py\b|\btest_\w+\.py\b")
ISSUE = re.compile(r"\bissues?\s*#?\d+|(?<![\w&])#\d{1,4}\b", re.I)


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*$", _without_code_blocks(page.read_text(encoding="utf-8")), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_config_reference_is_generated_from_the_config_models_and_up_to_date():
    gen = _generator()
    want = gen.render()
    have = (DOCS / "config.md").read_text(encoding="utf-8") if (DOCS / "config.md").is_file() else ""
    assert have == want, f"docs/config.md is stale: run `{gen.COMMAND}` and commit docs/config.md"


def test_the_config_reference_documents_every_field_of_every_section():
    from pydantic import BaseModel

    from trainpipe.config import RunConfig

    text = (DOCS / "config.md").read_text(encoding="utf-8")
    seen, todo, missing = set(), [RunConfig], []
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            if f"| `{name}` |" not in text:
                missing.append(f"{model.__name__}.{name}")
            if not (field.description or "").strip():
                missing.append(f"{model.__name__}.{name} (no docstring)")
            todo += [m for m in _generator()._models_in(field.annotation) if issubclass(m, BaseModel)]
    assert not missing, f"fields without a documented row in docs/config.md: {missing}"
    for key in ("learning_rate", "per_device_train_batch_size", "name_or_path", "peft", "sources"):
        assert f"| `{key}` |" in text


def test_readme_is_short_and_keeps_the_commands_ci_and_the_quickstart_use():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines (at most 200; move reference text to docs/)"
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in ci and "bash scripts/test.sh" in text
    assert "bash scripts/quickstart.sh" in text and "trainpipe run examples/quickstart/run.yaml" in text
    assert "docs/architecture.md" in text  # "where to read the code" points at the architecture page


def test_every_reference_page_exists_and_the_readme_links_it():
    text = README.read_text(encoding="utf-8")
    for page in PAGES:
        assert (DOCS / f"{page}.md").is_file(), f"docs/{page}.md is missing"
        assert f"(docs/{page}.md)" in text, f"README.md does not link docs/{page}.md"


def test_links_stay_inside_the_repository_and_resolve():
    bad = []
    for path in _prose_files():
        for m in LINK.finditer(_without_code_blocks(path.read_text(encoding="utf-8"))):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, file:, mailto: ... leave the repository
                bad.append(f"{path.relative_to(REPO)}: {target} (outside the repository)")
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.is_relative_to(REPO):
                bad.append(f"{path.relative_to(REPO)}: {target} (outside the repository)")
            elif not resolved.exists():
                bad.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                bad.append(f"{path.relative_to(REPO)}: {target} (no heading `#{anchor}` there)")
    for path in _prose_files():  # a path written out that leaves the repository (`../shared/...`)
        for m in re.finditer(r"(?<![\w.])\.\./[\w./-]+", path.read_text(encoding="utf-8")):
            resolved = (path.parent / m.group(0)).resolve()
            if not resolved.is_relative_to(REPO):
                bad.append(f"{path.relative_to(REPO)}: {m.group(0)} (outside the repository)")
    assert not bad, "\n".join(bad)


def test_no_test_file_names_or_issue_numbers_in_user_prose():
    bad = []
    for path in _prose_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for rx, what in ((TEST_FILE, "a test file name"), (ISSUE, "an internal issue number")):
                for m in rx.finditer(line):
                    bad.append(f"{path.relative_to(REPO)}:{n}: {what}: {m.group(0)!r}")
            if path.name not in ("testing.md",) and re.search(r"(?<![\w/])tests/", line):
                bad.append(f"{path.relative_to(REPO)}:{n}: a test folder (only docs/testing.md names them): {line.strip()[:80]!r}")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The patterns above match what they must (a guard against a check that passes on everything)."""
    assert TEST_FILE.search("see tests/e2e/test_sft.py") and TEST_FILE.search("`test_eval_runs.py` proves it")
    assert ISSUE.search("fixed in issue 23") and ISSUE.search("(issue #7)") and not ISSUE.search("exit code 2")
    assert LINK.search("[design](../shared/DESIGN.md)").group(1) == "../shared/DESIGN.md"
    assert not _without_code_blocks("```\n[x](http://a)\n```\n").strip()
    page = tmp_path / "p.md"
    page.write_text("# The run directory (`output_dir`)\n## Huge or hostile data\n")
    assert _anchors(page) == {"the-run-directory-output_dir", "huge-or-hostile-data"}


def _cli():
    import typer

    from trainpipe.cli import app

    return typer.main.get_command(app)


def _command(root, words: list[str]):
    """The click command `trainpipe WORDS...` names, and how many words named it (None when the first is no command)."""
    cmd, used = root, 0
    for w in words:
        if w in getattr(cmd, "commands", {}):
            cmd, used = cmd.commands[w], used + 1
        else:
            break
    return (cmd, used) if used else (None, 0)


def test_every_command_and_option_the_docs_show_exists():
    """Each `trainpipe CMD [SUB]` in the README and docs/ is a real command, and each `--option` on a command line of a
    code block is one of that command's options, so the docs cannot drift from the CLI unnoticed."""
    root = _cli()
    bad = []
    for path in _prose_files():
        text = path.read_text(encoding="utf-8")
        blocks = "\n".join(re.findall(r"^```(?:bash|sh|console)?\n(.*?)^```", text, flags=re.S | re.M))
        for line in blocks.splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line.startswith("trainpipe "):
                continue
            words = line.split()[1:]
            cmd, used = _command(root, words)
            if cmd is None:
                bad.append(f"{path.relative_to(REPO)}: `{line}`: no command `{words[0]}`")
                continue
            if hasattr(cmd, "commands"):
                bad.append(f"{path.relative_to(REPO)}: `{line}`: `{' '.join(words[:used])}` needs a subcommand")
                continue
            known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
            for w in words[used:]:
                opt = w.split("=", 1)[0]
                if opt.startswith("--") and opt not in known and "|" not in opt and "[" not in opt:
                    bad.append(f"{path.relative_to(REPO)}: `{line}`: `trainpipe {' '.join(words[:used])}` has no option {opt}")
        for m in re.finditer(r"`trainpipe ((?:[a-z][\w-]*)(?: [a-z][\w-]*)?)", text):
            words = m.group(1).split()
            cmd, used = _command(root, words)
            if cmd is None:
                bad.append(f"{path.relative_to(REPO)}: `trainpipe {m.group(1)}`: no such command")
    assert not bad, "\n".join(sorted(set(bad)))


def test_every_yaml_example_in_the_docs_is_a_valid_config():
    """A YAML block of the README or docs/ is a config (or the sections of one, laid over a minimal model + data)
    that `RunConfig` accepts: an example that no longer validates is a doc that lies."""
    import yaml

    from trainpipe.config import RunConfig

    base = {"model": {"name_or_path": "./base"}, "data": {"sources": [{"path": "train.jsonl"}]}}
    seen, bad = 0, []
    for path in _prose_files():
        for block in re.findall(r"^```yaml\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M):
            seen += 1
            try:
                RunConfig.model_validate({**base, **yaml.safe_load(block)})
            except Exception as e:  # noqa: BLE001 - every failing block is reported
                bad.append(f"{path.relative_to(REPO)}:\n{block}\n-> {e}")
    assert seen >= 3 and not bad, "\n\n".join(bad)


def test_every_source_file_the_docs_name_exists():
    """A `pkg/module.py` the README or docs/ name (relative to the repository or to src/trainpipe/) exists: code that
    moves takes its docs along."""
    bad = []
    for path in _prose_files():
        for m in re.finditer(r"`((?:src/)?[\w.-]+(?:/[\w.-]+)*/[\w-]+\.py)`", path.read_text(encoding="utf-8")):
            if not any((base / m.group(1)).is_file() for base in (REPO, REPO / "src" / "trainpipe")):
                bad.append(f"{path.relative_to(REPO)}: `{m.group(1)}`")
    assert not bad, "no such file:\n" + "\n".join(bad)
