# Quick start: `make run` runs the engine on the default workload; `make test` runs the tests.
# Both create .venv and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first, pinned, so that nothing pulls a
# multi-GB CUDA build onto a CPU machine. On a GPU machine: make TORCH=torch ...
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

$(STAMP): pyproject.toml examples/ttl_connector/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]' -e examples/ttl_connector
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvconnector run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info
