# syntax=docker/dockerfile:1.7
# The GPU worker: Ballast's worker on top of vLLM's official image, which brings CUDA, a torch
# build that matches it, vLLM and NVML.
#
#   docker build -f deploy/docker/worker-gpu.Dockerfile -t ballast/worker-gpu:0.1.0 .
#
# Bump VLLM_IMAGE together with the vllm pin of pyproject's `gpu` extra: the install below
# refuses to replace the image's torch or vLLM, so a mismatch fails the build instead of
# shipping a second, untested CUDA stack.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
# Only builds Ballast's wheel; its Python minor version does not matter for a pure wheel.
ARG WHEEL_BUILDER_IMAGE=python:3.12.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${WHEEL_BUILDER_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
FROM ${VLLM_IMAGE} AS worker-gpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=wheel /wheels /wheels
# The constraints pin what the image already has, so resolving Ballast's dependencies can add
# packages but never swap the CUDA stack underneath vLLM.
RUN python3 -m pip freeze \
      | grep -iE '^(torch|torchvision|torchaudio|vllm|triton|xformers|flashinfer[-_a-z0-9]*|nvidia-[-_a-z0-9]+)==' \
      > /tmp/image-constraints.txt \
 && python3 -m pip install --constraint /tmp/image-constraints.txt "$(ls /wheels/ballast-*.whl)[gpu]" \
 && rm -rf /wheels /tmp/image-constraints.txt

# Same uid/gid as the CPU images, so the Kubernetes securityContext is the same for both.
RUN groupadd --system --gid 10001 ballast \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/ballast --create-home ballast
# vLLM, Triton, torch.compile and Hugging Face all write caches; point them at /cache (a volume
# in Kubernetes) so the root filesystem can stay read-only. Weights come from a mounted model
# folder, never from a hub at run time.
ENV HOME=/home/ballast \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/hf \
    HF_HUB_OFFLINE=1 \
    VLLM_CACHE_ROOT=/cache/vllm \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    BALLAST_CONFIG=/etc/ballast/ballast.yaml
WORKDIR /home/ballast
USER 10001:10001
EXPOSE 50055 9464
# The vLLM image's entrypoint is its OpenAI server; this image runs Ballast's worker instead.
ENTRYPOINT ["ballast-worker"]
CMD []
