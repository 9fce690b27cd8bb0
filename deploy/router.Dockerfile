# Router image: the public OpenAI-compatible endpoint. FastAPI, httpx and aiohttp only: no vLLM, no torch.
# Build from the repository root:  docker build -f deploy/router.Dockerfile -t hybrid-pd-router .
# Any Debian-based image with Python 3.11 can be the base (--build-arg BASE_IMAGE=...).
ARG BASE_IMAGE=python:3.11.14-slim-trixie
FROM ${BASE_IMAGE}

ARG APP_UID=10001
# Air-gapped builds take the lock from a wheelhouse instead of an index:
# --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=<directory URL of the wheels>.
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python3 -m venv "$VIRTUAL_ENV" \
 && useradd --create-home --uid "$APP_UID" --shell /usr/sbin/nologin hybrid

WORKDIR /opt/hybrid-pd
COPY deploy/locks/router.txt deploy/locks/router.txt
RUN pip install --no-deps -r deploy/locks/router.txt

COPY pyproject.toml README.md ./
COPY hybrid_pd hybrid_pd
# The project without extras: the router's own dependencies, nothing of the workers'.
RUN pip install --no-deps . \
 && python -c "import hybrid_pd.cli, hybrid_pd.router.app" \
 && ! python -c "import vllm" 2>/dev/null \
 && ! python -c "import torch" 2>/dev/null

USER hybrid
CMD ["hybrid-pd", "router", "--host", "0.0.0.0", "--port", "8000"]
