# vitrieval images; docs/deploy.md explains the choices.
#
#   docker build --target serve -t vitrieval-serve .                            # CPU serving
#   docker build --target serve --build-arg RUNTIME=gpu -t vitrieval-serve:gpu .  # CUDA serving
#   docker build --target train -t vitrieval-train .                            # torch + timm
#
# The serving image has no torch: the project wheel (--no-deps) plus the base
# dependencies and the `serve` extra of pyproject.toml, listed by docker/requirements.py
# (RUNTIME=gpu swaps onnxruntime -> onnxruntime-gpu and faiss-cpu -> FAISS_GPU).
# BuildKit (Docker 23+'s default builder) builds only the stages a target needs; the
# classic builder also builds (pulls) the other runtime's base image.

ARG PYTHON_VERSION=3.12
ARG RUNTIME=cpu
# onnxruntime-gpu 1.31's CUDA provider links CUDA 13 and cuDNN 9: the base image must match
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

# ---- builder: the project wheel and each image's requirement list ------------------
FROM python:${PYTHON_VERSION}-slim AS builder
# the GPU FAISS wheel: faiss-gpu (Meta's, CUDA 12 from pip, compute capability 7.0-9.0)
ARG FAISS_GPU=faiss-gpu
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY docker/requirements.py docker/requirements.py
COPY vitrieval vitrieval
COPY index index
COPY service service
COPY training training
COPY distributed distributed
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist . \
 && python docker/requirements.py serve --runtime cpu > /dist/serve-cpu.txt \
 && python docker/requirements.py serve --runtime gpu --faiss-gpu "$FAISS_GPU" > /dist/serve-gpu.txt \
 && python docker/requirements.py train > /dist/train.txt

# ---- the two serving bases: a Python in /opt/venv, nothing else -------------------
FROM python:${PYTHON_VERSION}-slim AS runtime-cpu
RUN python3 -m venv /opt/venv

FROM ${CUDA_IMAGE} AS runtime-gpu
# Ubuntu 24.04's Python is 3.12; the CUDA and cuDNN libraries come with the base image
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# ---- serve: vitrieval-serve on ONNX Runtime + FAISS, no torch ----------------------
FROM runtime-${RUNTIME} AS serve
ARG RUNTIME
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=builder /dist /tmp/dist
RUN pip install --only-binary=:all: -r /tmp/dist/serve-${RUNTIME}.txt \
 && pip install --no-deps /tmp/dist/vitrieval-*.whl \
 && rm -rf /tmp/dist \
 && python -c "import importlib.util as u, faiss, onnxruntime, vitrieval.index.store, vitrieval.service.app; \
assert u.find_spec('torch') is None, 'torch must not be in the serving image'" \
 && vitrieval-serve --help > /dev/null \
 && useradd --system --uid 10001 --user-group --create-home --shell /usr/sbin/nologin vitrieval \
 && mkdir -p /models /index /data \
 && chown vitrieval:vitrieval /models /index /data
# the defaults of the flags; every setting is an environment variable (service/settings.py)
ENV VITRIEVAL_MODEL=/models/model.onnx \
    VITRIEVAL_INDEX=/index \
    VITRIEVAL_HOST=0.0.0.0 \
    VITRIEVAL_PORT=8000
USER 10001:10001
WORKDIR /home/vitrieval
EXPOSE 8000
# /healthz answers once the model and index are loaded (the port is bound after that)
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('VITRIEVAL_PORT', '8000'), timeout=4)"
ENTRYPOINT ["vitrieval-serve"]

# ---- train: vitrieval-train with torch, torchvision, timm -------------------------
# torch's default wheels carry their CUDA libraries; the image trains on a GPU when
# the container is given one (--gpus / a compose device reservation), else on the CPU.
FROM python:${PYTHON_VERSION}-slim AS train
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    MPLBACKEND=Agg
COPY --from=builder /dist /tmp/dist
RUN python3 -m venv /opt/venv \
 && pip install --only-binary=:all: -r /tmp/dist/train.txt \
 && pip install --no-deps /tmp/dist/vitrieval-*.whl \
 && rm -rf /tmp/dist \
 && vitrieval-train --help > /dev/null \
 && useradd --system --uid 10001 --user-group --create-home --shell /usr/sbin/nologin vitrieval \
 && mkdir -p /models /runs /data \
 && chown vitrieval:vitrieval /models /runs /data
USER 10001:10001
WORKDIR /home/vitrieval
# `fit --recipe recipes/jcf_three_step.yaml` works from the working folder
COPY --chown=10001:10001 recipes recipes
ENTRYPOINT ["vitrieval-train"]
CMD ["--help"]
