# Quick start: `make run` runs the engine on the default workload; `make test` runs the tests.
# Both create .venv and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first, pinned to its "+cpu" local version,
# so that nothing pulls a multi-GB CUDA build onto a CPU machine (PyPI's plain
# Linux torch wheel is the CUDA build). Where no local wheel or CPU index is
# configured: make TORCH_INDEX=https://download.pytorch.org/whl/cpu ...
# On a GPU machine: make TORCH=torch ...
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean lint

$(STAMP): pyproject.toml examples/ttl_connector/pyproject.toml examples/disk_connector/pyproject.toml \
		examples/s3fifo_policy/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)" \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		|| { echo "could not install $(TORCH); set TORCH_INDEX (CPU wheels) or TORCH=torch (GPU machine)"; exit 1; }
	$(PY) -m pip install -q -e '.[test]' -e examples/ttl_connector -e examples/disk_connector \
		-e examples/s3fifo_policy
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvconnector run $(ARGS)

test: $(STAMP)
	@command -v redis-server >/dev/null || echo "note: redis-server is not installed, so the Redis tier tests will skip; install it with: apt-get install -y redis-server"
	@command -v openssl >/dev/null || echo "note: openssl is not installed, so the Redis TLS tests will skip; install it with: apt-get install -y openssl"
	$(PY) -m pytest -q $(ARGS)

# ruff and mypy --strict on the library and the example connectors (settings in
# pyproject.toml; the tools are pinned in requirements/lint.txt).
LINT_PATHS := kvconnector_core connectors examples/ttl_connector/ttl_connector examples/disk_connector/disk_connector \
	examples/s3fifo_policy/s3fifo_policy
LINT_STAMP := $(VENV)/.lint-installed

$(LINT_STAMP): requirements/lint.txt $(STAMP)
	$(PY) -m pip install -q -r requirements/lint.txt
	touch $(LINT_STAMP)

# Tests are held to the line length only; tools/check_shape.py checks function length
# and complexity (ruff's mccabe count is laxer than radon's).
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff check --select E501 tests examples/ttl_connector/tests examples/disk_connector/tests
	$(VENV)/bin/mypy $(LINT_PATHS)
	$(PY) tools/check_shape.py $(LINT_PATHS)

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info

# vLLM 0.33 on CPU, in its own venv so that it never touches the project's environment:
# the adapter's test suite (`make test-vllm`, run by CI) and the side-by-side benchmarks
# (`make compare-vllm`, `make bench-vllm`). torch is pinned and installed first; vllm and
# its CPU requirements (requirements/vllm-0.33-cpu.txt) go in with --no-deps so nothing
# can pull another torch.
VLLM_VENV ?= .vllm-venv
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQS ?= requirements/vllm-0.33-cpu.txt

.PHONY: compare-vllm vllm-venv test-vllm bench-vllm

$(VLLM_STAMP): pyproject.toml examples/ttl_connector/pyproject.toml $(VLLM_REQS)
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH)" \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pip install -q --no-deps vllm==0.33.0
	$(VLLM_PY) -m pip install -q --no-deps -r $(VLLM_REQS)
	$(VLLM_PY) -m pip install -q msgspec pluggy pytest hypothesis tqdm prometheus-client numpy
	$(VLLM_PY) -m pip install -q --no-deps -e . -e examples/ttl_connector
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

compare-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) benchmarks/compare_vllm.py $(ARGS)

# The adapter under vLLM's own Scheduler and worker connector code. pytest's exit 5
# ("no tests collected") is turned into a failure: this suite must always run.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -c "import vllm, kvconnector_core.integrations.vllm" 2>/dev/null \
		|| { echo "vLLM 0.33 or the adapter does not import in $(VLLM_VENV)"; exit 1; }
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/integrations/vllm $(ARGS); \
		rc=$$?; if [ $$rc -eq 5 ]; then echo "test-vllm collected no tests"; exit 1; fi; exit $$rc

bench-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) benchmarks/bench_vllm_adapter.py $(ARGS)
