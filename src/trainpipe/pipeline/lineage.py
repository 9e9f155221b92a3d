"""`trainpipe lineage RUN_DIR_OR_MODEL`: what produced a model, as the chain data -> config -> code -> model.

Read from what the run wrote: `manifest.json` (data SHA-256s, config hash, trainpipe version and git state, packages,
a stage's `lineage`: the model it started from), `tracking.json` (the registered model version), `pipeline.json` (the
pipeline's step keys and the content-addressed artefacts) and, for a model exported by `trainpipe pipeline`, the
`lineage.json` inside it (the step that made it, its parent artefacts by digest)."""

from __future__ import annotations

import json
from pathlib import Path

from trainpipe.errors import RunDirError
from trainpipe.hashing import file_sha256


def _json(p: Path) -> dict:
    """The mapping a JSON file holds; {} when it is missing, damaged or not a mapping (a damaged manifest: issue 22)."""
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _weights(model: Path) -> dict[str, str]:
    return {f.name: file_sha256(f) for f in sorted(model.glob("*.safetensors"))} if model.is_dir() else {}


def lineage_of(target: str | Path) -> dict:
    p = Path(target).resolve()
    if not p.exists():
        raise RunDirError(f"`{target}` does not exist; give a run directory (the `output_dir` of a run) or an exported model folder.")
    model_lineage = _json(p / "lineage.json") if (p / "config.json").exists() or (p / "adapter").is_dir() else {}
    if (p / "manifest.json").exists():
        run_dir, model = p, p / "model"
    elif (p.parent / "manifest.json").exists():
        run_dir, model = p.parent, p
    elif model_lineage:
        run_dir, model = None, p
    else:
        raise RunDirError(
            f"`{p}` is neither a run directory (no manifest.json) nor a model trainpipe exported (no lineage.json, no run around it); "
            "give the `output_dir` of a run, its `model/`, or a model folder from the pipeline's artefact store."
        )
    info: dict = {"target": str(p), "run_dir": str(run_dir) if run_dir else None}
    if run_dir is not None:
        m = _json(run_dir / "manifest.json")
        info["data"] = m.get("data_files") or []
        info["config"] = {"hash": m.get("config_hash"), "file": m.get("config_path"), "resolved": str(run_dir / "config.resolved.yaml"), "seed": m.get("seed")}
        info["code"] = {"trainpipe_version": m.get("trainpipe_version"), "trainpipe_git": m.get("trainpipe_git"), "config_repo_git": m.get("git"),
                        "packages": m.get("packages")}
        info["parent"] = m.get("lineage")  # a stage: the model it started from
        tr = _json(run_dir / "tracking.json")
        info["registered"] = tr.get("registered")
        pipe = _json(run_dir / "pipeline.json")
        if pipe:
            info["pipeline"] = {s["id"]: {"status": s["status"], "key": s["key"], "outputs": s.get("outputs")} for s in pipe.get("steps", [])}
            reg = next((s for s in pipe.get("steps", []) if s["kind"] == "register"), None)
            if reg and not info["registered"]:
                info["registered"] = {"uri": (reg.get("outputs") or {}).get("registration", {}).get("uri")}
    if model_lineage:
        info["produced_by"] = model_lineage.get("produced_by")
        info["parents"] = model_lineage.get("parents")
        info.setdefault("code", {})["source_sha256"] = (model_lineage.get("code") or {}).get("source_sha256")
        info.setdefault("config", {})["hash"] = info.get("config", {}).get("hash") or model_lineage.get("config_hash")
    info["model"] = {"path": str(model), "exists": model.is_dir(), "weights_sha256": _weights(model)}
    return info


def format_chain(info: dict) -> str:
    lines = []
    data = info.get("data") or []
    lines.append("data")
    for d in data:
        lines.append(f"  {d.get('path')}  sha256 {d.get('sha256')}")
    if not data:
        parents = info.get("parents") or {}
        for name, par in parents.items():
            lines.append(f"  {name}: {par.get('step')}.{par.get('output')} digest {str(par.get('digest'))[:16]}")
    c = info.get("config") or {}
    lines.append("  -> config")
    lines.append(f"     hash {c.get('hash')}" + (f"  file {c['file']}" if c.get("file") else "") + (f"  seed {c['seed']}" if c.get("seed") is not None else ""))
    code = info.get("code") or {}
    git = code.get("trainpipe_git") or {}
    lines.append("  -> code")
    lines.append(f"     trainpipe {code.get('trainpipe_version')}" + (f"  commit {git.get('commit')}" if git.get("commit") else "")
                 + ("  (uncommitted changes)" if git.get("dirty") else "") + (f"  source {code['source_sha256'][:16]}" if code.get("source_sha256") else ""))
    pk = code.get("packages") or {}
    if pk:
        lines.append("     " + ", ".join(f"{k} {v}" for k, v in pk.items() if v))
    par = info.get("parent")
    if par and par.get("input_model"):
        im = par["input_model"]
        lines.append(f"     started from {im.get('path')} ({im.get('produced_by')})")
    m = info.get("model") or {}
    lines.append("  -> model")
    lines.append(f"     {m.get('path')}" + ("" if m.get("exists") else "  (not exported)"))
    for name, sha in (m.get("weights_sha256") or {}).items():
        lines.append(f"     {name}  sha256 {sha}")
    if info.get("produced_by"):
        pb = info["produced_by"]
        lines.append(f"     produced by pipeline step {pb.get('step')} (key {str(pb.get('key'))[:16]})")
    reg = info.get("registered")
    if reg and reg.get("name"):
        lines.append(f"     registered: {reg['name']} version {reg.get('version')}")
    return "\n".join(lines)
