"""Reading YAML safely (bounded against alias bombs) and `--set a.b=c` overrides."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from trainpipe.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (``1e-4`` -> float, ``[q,v]`` -> list)."""
    if "=" not in text:
        raise ConfigError(
            f"`--set {text}` is not an override: write `--set key.path=value`, e.g. `--set training.learning_rate=1e-4`.",
            [f"--set {text}: missing `=`"],
        )
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"`--set {text}`: the key path `{key}` is empty or has an empty part.", [f"--set {text}"])
    try:
        value = load_yaml_text(raw, f"`--set {text}`") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``a.b=c`` override set (creating sections as needed)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
                node[part] = nxt
            elif not isinstance(nxt, dict):
                raise ConfigError(
                    f"`--set {text}`: `{'.'.join(path[: i + 1])}` is a value, not a section, so it has no key `{path[i + 1]}`.",
                    [f"--set {text}"],
                )
            node = nxt
        node[path[-1]] = value
    return out


MAX_YAML_ALIASES = 1_000  # `*name` uses in one document: configs use a handful
MAX_YAML_NODES = 200_000  # values after every alias is expanded: a config has hundreds; a "billion laughs" file billions


class _YamlTooBig(Exception):
    pass


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses an alias bomb while composing, before anything is built: more than
    MAX_YAML_ALIASES alias uses, or more than MAX_YAML_NODES values once every alias is expanded (nine nested anchors
    of nine aliases each are 81 aliases but 9^9 values: safe_load builds them as shared objects, and the first thing that
    walks them, a validator or a dump, runs for ever)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _YamlTooBig(f"uses more than {MAX_YAML_ALIASES:,} aliases (`*name`)")
        return super().compose_node(parent, index)

    def construct_document(self, node):
        sizes: dict[int, int] = {}

        def size(n) -> int:
            if id(n) in sizes:
                return sizes[id(n)]
            total = 1
            if isinstance(n, yaml.SequenceNode):
                total += sum(size(c) for c in n.value)
            elif isinstance(n, yaml.MappingNode):
                total += sum(size(k) + size(v) for k, v in n.value)
            if total > MAX_YAML_NODES:
                raise _YamlTooBig(f"expands to more than {MAX_YAML_NODES:,} values once its aliases (`*name`) are filled in")
            sizes[id(n)] = total
            return total

        size(node)
        return super().construct_document(node)


def load_yaml_text(text: str, source: str):
    """``yaml.safe_load`` of ``text`` through BoundedLoader: every config trainpipe reads (a run config, best.yaml,
    config.resolved.yaml, a ``--set`` value). ``source`` names it in the error: an alias bomb or nesting too deep is a
    ConfigError (one paragraph); a syntax error stays ``yaml.YAMLError`` for the caller to place."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - BoundedLoader is a SafeLoader
    except _YamlTooBig as exc:
        raise ConfigError(
            f"{source} was refused: its YAML {exc}, the shape of an alias bomb (\"billion laughs\": nested anchors `&a` "
            "whose aliases `*a` multiply), which would exhaust memory or never finish. Write the values out, or use far fewer "
            "anchors and aliases.") from None
    except RecursionError:
        raise ConfigError(f"{source} was refused: its YAML nests lists or mappings too deeply to read (thousands of levels). "
                          "A run config is a few levels deep; fix the brackets or indentation.") from None


def read_yaml_file(path: str | Path, what: str = "Config file") -> Any:
    """The YAML document of ``path`` (BoundedLoader); a missing file, a folder, bytes that are not UTF-8 text and bad
    syntax are ConfigErrors naming the file."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} `{p}` is a folder, not a file. Pass the YAML file itself (e.g. `{p}/run.yaml`).")
    if not p.is_file():
        raise ConfigError(f"{what} `{p}` does not exist. Check the path, or start from `examples/quickstart/run.yaml`.")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} `{p}` is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): is it a binary file? "
                          "A config is a YAML text file; check the path.") from None
    try:
        return load_yaml_text(text, f"`{p}`")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"`{p}` is not valid YAML{where}: {problem}. Fix the syntax there (indentation, a missing `:` or quote).") from None


def read_yaml(path: str | Path) -> dict:
    """Read a config file (``read_yaml_file``: safe, bounded); YAML syntax errors name the line."""
    p = Path(path)
    data = read_yaml_file(p)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"`{p}` must hold a mapping of sections (model, data, ...), got a {type(data).__name__}.")
    return data
