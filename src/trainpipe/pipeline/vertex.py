"""`trainpipe pipeline compile CONFIG --target vertex`: the config's DAG for Vertex AI Pipelines.

Two files: the KFP IR (kfp_compile.py: Vertex runs KFP v2 pipelines as they are) and, beside it, the body of the
`projects.locations.pipelineJobs.create` request (`<file>.job.json`): display name, the IR as `pipelineSpec`, the
pipeline root and parameter values in `runtimeConfig`, labels, and the service account and network as references
(`${VERTEX_SERVICE_ACCOUNT}`, `${VERTEX_NETWORK}`, `${VERTEX_PIPELINE_ROOT}`) that the submit command fills from the
environment: no project's account or address is written. Both go through the ownership rule and redaction.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

import trainpipe
from trainpipe import ownership
from trainpipe.pipeline.kfp_compile import compile_pipeline, k8s_name, protected_reads
from trainpipe.redact import redact_obj, redact_text

PLACEHOLDERS = {"pipeline_root": "${VERTEX_PIPELINE_ROOT}", "service_account": "${VERTEX_SERVICE_ACCOUNT}", "network": "${VERTEX_NETWORK}"}


def _label(v: str) -> str:
    """A Vertex label value: lower case letters, digits, `_` and `-`, at most 63."""
    return re.sub(r"[^a-z0-9_-]", "-", v.lower())[:63]


def job_body(cfg, ir: dict, *, store_url: str) -> dict:
    """The PipelineJob create request (v1 REST, camelCase) for the compiled IR."""
    return {
        "displayName": k8s_name(cfg)[:128],
        "pipelineSpec": ir,
        "runtimeConfig": {"gcsOutputDirectory": PLACEHOLDERS["pipeline_root"], "parameterValues": {"store": store_url, "use_cache": True},
                          "failurePolicy": "PIPELINE_FAILURE_POLICY_FAIL_FAST"},
        "serviceAccount": PLACEHOLDERS["service_account"],
        "network": PLACEHOLDERS["network"],
        "labels": {"trainpipe-version": _label(trainpipe.__version__), "trainpipe-pipeline": _label(cfg.name or "run")},
    }


def compile_vertex(cfg, out: str | Path, *, store: str | None = None, image: str | None = None, config_path: str | Path | None = None) -> dict:
    out = Path(out)
    job = out.with_name(out.stem + ".job.json")
    reads = protected_reads(cfg, config_path)
    for p, what in ((out, "the Vertex pipeline (KFP IR)"), (job, "the Vertex PipelineJob request body")):
        ownership.check_writable(p, what=what, reads=reads)
    info = compile_pipeline(cfg, out, store=store, image=image, config_path=config_path, what="the Vertex pipeline (KFP IR)")
    ir = yaml.safe_load(info["text"])
    store_url = ir["root"]["inputDefinitions"]["parameters"]["store"].get("defaultValue", "")
    body = redact_obj(job_body(cfg, ir, store_url=store_url))
    ownership.write_text(job, redact_text(json.dumps(body, indent=2)) + "\n", what="the Vertex PipelineJob request body", reads=reads)
    submit = ("envsubst < " + str(job) + " > /tmp/vertex-job.json && curl -sS -X POST -H \"Authorization: Bearer $(gcloud auth print-access-token)\" "
              "-H 'Content-Type: application/json' -d @/tmp/vertex-job.json "
              "\"https://${VERTEX_REGION}-aiplatform.googleapis.com/v1/projects/${VERTEX_PROJECT}/locations/${VERTEX_REGION}/pipelineJobs\"   "
              "(set VERTEX_PROJECT, VERTEX_REGION, VERTEX_PIPELINE_ROOT=gs://..., VERTEX_SERVICE_ACCOUNT, VERTEX_NETWORK first)")
    return {"path": str(out), "job": str(job), "submit": submit, "notes": info["notes"], "body": body}
