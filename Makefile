# Two commands from a fresh clone: `make test` and `make demo`. Both create .venv and install what
# they need (torch 2.14.1 is the CUDA 13.0 build; it brings triton 3.8).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.14.1
TORCHVISION_VERSION ?= 0.29.1
# CUDA kernels are compiled (not run) even without a GPU; NANSCAN_CUDA=0 skips them, unset = auto.
export NANSCAN_CUDA ?= 1
export MAX_JOBS ?= 2
# Benchmarks in quick mode: a few rounds each, enough for the ratio table, not for publication.
QUICK_BENCH := --benchmark-min-rounds=3 --benchmark-max-time=0.5 --benchmark-warmup=off -p no:randomly

# (test-fused: the compiled monitor tests with records fused into inductor's kernels, as CI runs them)
.PHONY: test test-fused test-compat demo build bench bench-full info clean

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=23" setuptools wheel
	$(PY) -m pip install "torch==$(TORCH_VERSION)" numpy pytest pytest-benchmark matplotlib ninja "ruff==0.17.6"
	# third-party models, the HF Trainer and Lightning for tests/test_real_models.py, test_integrations.py
	# and test_lightning.py
	$(PY) -m pip install "torchvision==$(TORCHVISION_VERSION)" "transformers==5.24.0" "timm==1.0.31" "accelerate==1.15.0" \
		"lightning==2.6.6"
	# tests/test_telemetry_sinks.py reads back what the real trackers stored (W&B offline, MLflow SQLite)
	$(PY) -m pip install "tensorboard==2.21.0" "wandb==0.31.0" "mlflow==3.17.2"
	# tests/test_report_html.py lays the HTML report out in a real headless browser (Debian's chromium; CI runs as root)
	command -v chromium >/dev/null 2>&1 || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	touch $@

# The build stamp depends on every C++/CUDA source, so editing csrc/ rebuilds.
$(VENV)/.built: $(VENV)/.deps setup.py $(shell find csrc -type f -not -name '*.md')
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	$(PY) -m nanscan info
	touch $@

build: $(VENV)/.built

test: build
	$(VENV)/bin/ruff check nanscan tests benchmarks setup.py
	$(PY) -m pytest -q --durations=25 tests
	$(PY) -m pytest -q benchmarks $(QUICK_BENCH) --benchmark-columns=median,iqr,rounds --benchmark-sort=name

# Records fused into compiled kernels are opt-in (NANSCAN_FUSED_RECORDS=1): the compiled monitor's
# tests again with them on, which must name the same incidents.
test-fused: build
	NANSCAN_FUSED_RECORDS=1 $(PY) -m pytest -q tests/test_monitor_compiled.py

bench: build
	$(PY) -m pytest -q benchmarks --benchmark-columns=median,iqr,rounds --benchmark-json=benchmarks/results/latest-cpu.json

demo: build
	$(PY) -m nanscan demo

# The GPU machine's stack (torch 2.11 / triton 3.6, transformers 5.17): the same extension and test
# suite in a second venv (the HF Trainer / Lightning / tracker tests skip there: their pins target
# the newest torch).
COMPAT_VENV ?= .venv-compat
COMPAT_TORCH ?= 2.11.0
COMPAT_TORCHVISION ?= 0.26.0
test-compat:
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --upgrade "pip>=23" setuptools wheel
	$(COMPAT_VENV)/bin/python -m pip install "torch==$(COMPAT_TORCH)" numpy pytest pytest-benchmark matplotlib ninja \
		"tensorboard==2.21.0"
	# the GPU machine's transformers and accelerate, and timm: the real-model and HF Trainer tests
	# (tests/test_compiled_real_models.py, test_real_models.py, test_integrations.py) on this torch too
	$(COMPAT_VENV)/bin/python -m pip install "torchvision==$(COMPAT_TORCHVISION)" "transformers==5.17.0" "timm==1.0.31" \
		"accelerate==1.15.0"
	TORCH_CUDA_ARCH_LIST="9.0" $(COMPAT_VENV)/bin/python -m pip install --no-build-isolation --no-deps -e .  # (sm_90: the H200)
	$(COMPAT_VENV)/bin/python -m nanscan info
	$(COMPAT_VENV)/bin/python -m pytest -q tests
	# the compat build replaced nanscan/_C*.so: the main venv's build stamp is void
	rm -f $(VENV)/.built

info: build
	$(PY) -m nanscan info

clean:
	rm -rf build nanscan/_C*.so nanscan/_build_info.json $(VENV)/.built
