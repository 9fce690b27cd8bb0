# GPU worker image: `hybrid-pd prefill|decode` on NVIDIA GPUs (vLLM + NIXL, CUDA 13).
# Build from the repository root:  docker build -f deploy/worker-gpu.Dockerfile -t hybrid-pd-worker-gpu .
# The host needs an NVIDIA driver for CUDA 13 and the NVIDIA Container Toolkit.
# vLLM 0.26.0 (deploy/locks/gpu.txt, torch 2.11.0): the vLLM verified on GPUs (README, "Which vLLM").
# Workers probe it at start (hybrid_pd/connector/vllm/capabilities.py) and refuse a vLLM that lacks a P/D piece.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

ARG APP_UID=10001
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    HYBRID_PD_HOME=/cache/hybrid-pd

# python3-dev, gcc, g++: Triton (vLLM's Mamba kernels) compiles its launchers at run time.
# libibverbs1, librdmacm1, ibverbs-providers: RDMA transports of UCX between nodes.
# libnuma1, libgomp1: vLLM and the NIXL plugins link them.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc g++ \
        libnuma1 libgomp1 libibverbs1 librdmacm1 ibverbs-providers ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV" \
 && useradd --create-home --uid "$APP_UID" --shell /usr/sbin/nologin hybrid \
 && mkdir -p /cache/huggingface /cache/hybrid-pd /models \
 && chown -R hybrid:hybrid /cache

WORKDIR /opt/hybrid-pd
# Third-party packages first (a layer that survives code changes), exactly as locked.
COPY deploy/locks/gpu.txt deploy/locks/gpu.txt
RUN pip install --no-deps -r deploy/locks/gpu.txt

COPY pyproject.toml README.md ./
COPY hybrid_pd hybrid_pd
COPY deploy/fetch_model.py deploy/fetch_model.py
RUN pip install --no-deps . \
 && python -c "import vllm, nixl, transformers, hybrid_pd.cli"

USER hybrid
CMD ["hybrid-pd", "--help"]
