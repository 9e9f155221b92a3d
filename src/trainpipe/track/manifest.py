"""The run manifest: what exactly produced this run (config hash, data hashes, code, versions, hardware)."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

import trainpipe
from trainpipe import ownership

PACKAGES = ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "tokenizers", "safetensors")


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_state(path: str | Path) -> dict:
    """Commit and dirtiness of the git work tree holding ``path`` (None outside a repo)."""
    cwd = Path(path)
    cwd = cwd if cwd.is_dir() else cwd.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True, timeout=10)
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def build_manifest(*, config_hash: str, config_path: str | None, data_files: list[dict], seed: int, hardware: dict, decisions: list[dict]) -> dict:
    return {
        "trainpipe_version": trainpipe.__version__,
        "config_hash": config_hash,
        "config_path": config_path,
        "data_files": data_files,
        "git": git_state(config_path or "."),
        "trainpipe_git": git_state(Path(trainpipe.__file__).parent),
        "packages": package_versions(),
        "seed": seed,
        "hardware": hardware,
        "decisions": decisions,
    }


def write_json(path: str | Path, obj: dict, *, what: str | None = None, reads=()) -> None:
    """Write JSON through the ownership rule (ownership.write_json): every credential redacted (trainpipe.redact),
    atomically (a temporary file, then a rename: a full disk leaves the old file as it was), recorded in the manifest of
    its folder; a new path, or a file trainpipe wrote there and nobody changed since (each write records the new
    content, so a run's JSON files can be rewritten as often as it likes), never a file trainpipe did not write nor any
    of ``reads`` (OwnershipError, nothing written)."""
    p = Path(path)
    ownership.write_json(p, obj, what=what or f"`{p.name}`", reads=reads)


def update_manifest(run_dir: str | Path, change) -> bool:
    """Change a run's `manifest.json` in place: ``change(manifest)`` edits the dict, which is written back through
    :func:`write_json` (the ownership rule and redaction, atomically). False, and nothing written, when the run has no
    manifest yet. Every later addition to the manifest (the world size, the loss implementation) goes through here."""
    import json

    path = Path(run_dir) / "manifest.json"
    if not path.exists():
        return False
    man = json.loads(path.read_text(encoding="utf-8"))
    change(man)
    write_json(path, man, what="the run manifest `manifest.json`")
    return True
