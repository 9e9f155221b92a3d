# The trainpipe image the cluster launch files name (`trainpipe launch --emit k8s|skypilot`): trainpipe:<version>.
#   docker build -t trainpipe:0.1.0 .
# The tag is trainpipe's version (pyproject.toml); the launch files pin the same tag. CUDA torch from PyTorch's own
# wheels (the build that runs on GPU nodes), everything else at the versions scripts/constraints.txt pins (the versions
# the test suite passed with). The extras: every one trainpipe's code imports (tracking, tuning, quantization, evaluation,
# Kubeflow tasks, data formats, exports; tests/unit/test_cluster_files.py compares this list with src/'s imports), except
# `presidio` (needs a spaCy model) and `timm` (needs torchvision built for this torch: add it from the same index).
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends bash ca-certificates git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/trainpipe
COPY pyproject.toml README.md ./
COPY scripts/constraints.txt scripts/constraints.txt
COPY src ./src

RUN python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && python -m pip install -c scripts/constraints.txt ".[gpu,deepspeed,mlflow,wandb,tensorboard,tune,qlora,eval,kubeflow,sql,zstd,gguf,images,onnx]"

RUN useradd --create-home --uid 1000 trainpipe && mkdir -p /workspace && chown trainpipe /workspace
USER trainpipe
WORKDIR /workspace
ENTRYPOINT []
CMD ["trainpipe", "--help"]
