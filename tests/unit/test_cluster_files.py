"""Cluster files that run on a stock cluster (issue 33): the Kubeflow TrainJob mounts its data, config copies and outputs
from a PersistentVolumeClaim written beside it (the stock `torch-distributed` runtime mounts none), the CronJob's
ConfigMap and command carry the pod's paths only, and the image installs every extra trainpipe's code imports.

The files are validated against the stored CRD schema (tests/assets/schemas, strictly: an unknown field fails); no
cluster here, so nothing is applied. The install list is read from the Dockerfile and compared with the imports of
src/trainpipe mapped to pyproject's extras (the modules the emitted commands, `trainpipe run`, `pipeline step`,
`pipeline schedule`, `tune`, import on the image).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from test_dependencies import _dist_name, _imported_modules, _modules_of
from test_launch_files import SCHEMAS, emit, strict, write_config
from trainpipe.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_trainjob_mounts_the_workspace_claim_written_beside_it(tmp_path, capsys):
    import jsonschema

    configmap, job = yaml.safe_load_all(emit(tmp_path, "k8s"))
    crd = yaml.safe_load((SCHEMAS / "trainjob-v1alpha1.crd-excerpt.yaml").read_text())
    validator = jsonschema.Draft7Validator(strict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    assert not [e.message for e in validator.iter_errors(job)]
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = patch["template"]["spec"]["template"]["spec"]
    claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert patch["name"] == "node" and pod["containers"][0] == {"name": "node", "volumeMounts": [{"name": "workspace", "mountPath": "/workspace"}]}
    pvc = yaml.safe_load((tmp_path / "out" / "workspace-pvc.yaml").read_text())
    assert (pvc["kind"], pvc["metadata"]["name"], pvc["spec"]["accessModes"]) == ("PersistentVolumeClaim", claim, ["ReadWriteMany"])
    said = " ".join(capsys.readouterr().out.split())
    assert "kubectl apply -f workspace-pvc.yaml" in said and f"`{claim}`" in said
    carried = yaml.safe_load(configmap["data"]["run.yaml"])  # the config the job reads: everything under the claim's mount
    assert carried["output_dir"].startswith("/workspace/") and all(s["path"].startswith("/workspace/") for s in carried["data"]["sources"])
    bad = {**job, "spec": {**job["spec"], "runtimePatches": [{"trainingRuntimeSpec": {}}]}}  # the check is real: `manager` is required
    assert list(validator.iter_errors(bad))


def test_cronjob_configmap_and_command_carry_pod_paths_only(tmp_path, monkeypatch):
    from trainpipe.pipeline.schedule import emit_k8s_cronjob

    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw["output_dir"] = "runs/demo"  # relative to this machine's working folder
    raw["pipeline"] = {"store": str(tmp_path / "scratch" / "store")}  # a scratch folder of this machine
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "emitted" / "cron.yaml"
    out.parent.mkdir()
    emit_k8s_cronjob(load_config(config), cron="0 3 * * *", config_path=config, out=out, echo=lambda s: None)
    text = out.read_text()
    assert str(tmp_path) not in text and "runs/demo" not in text.replace("/workspace/outputs/demo", "")
    cronjob, cm = yaml.safe_load_all(text)
    mounted = yaml.safe_load(cm["data"][config.name])
    assert mounted["output_dir"] == "/workspace/outputs/demo" and mounted["pipeline"]["store"] == "/workspace/store"
    assert {s["path"] for s in mounted["data"]["sources"]} == {"/workspace/data/data/train.jsonl"}
    pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--store") + 1] == "/workspace/store"
    claim = pod["volumes"][1]["persistentVolumeClaim"]["claimName"]
    assert {"name": "workspace", "mountPath": "/workspace"} in pod["containers"][0]["volumeMounts"]
    assert yaml.safe_load((out.parent / "workspace-pvc.yaml").read_text())["metadata"]["name"] == claim


# extras the image leaves out, each with its reason
NOT_IN_IMAGE = {
    "dev": "the test suite",
    "presidio": "needs a spaCy language model the image cannot download at build time; `data.pii.presidio` is opt-in",
    "timm": "needs torchvision built for the image's CUDA torch (from the PyTorch index, not PyPI); docs/images.md",
}


def _image_extras() -> set[str]:
    docker = (REPO / "Dockerfile").read_text()
    m = re.search(r'-c scripts/constraints\.txt "\.\[([a-z0-9,\-]+)\]"', docker)
    assert m, "the Dockerfile installs trainpipe with its extras, pinned by scripts/constraints.txt"
    return set(m.group(1).split(","))


def test_the_image_installs_every_extra_the_code_imports_at_pinned_versions():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    imported = set(_imported_modules())
    needed = {name for name, reqs in extras.items() if name not in NOT_IN_IMAGE
              and any(_modules_of(_dist_name(r)) & imported for r in reqs)}
    assert {"mlflow", "tune", "qlora"} <= needed  # tracking, tuning and quantization: what the emitted runs use
    missing = needed - _image_extras()
    assert not missing, f"the Dockerfile's image lacks the extras {sorted(missing)}, which src/trainpipe imports"
    pins = {_dist_name(line) for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines() if "==" in line}
    unpinned = sorted(_dist_name(r) for e in _image_extras() for r in extras[e] if _dist_name(r) not in pins)
    assert not unpinned, f"installed in the image without a pin in scripts/constraints.txt: {unpinned}"
