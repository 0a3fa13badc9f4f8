# Two entry points (README): `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: run test test-kernels install install-test clean data

# torch first, pinned to the CPU wheel already on these machines, so no CUDA build is pulled.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job: plan for MNIST-1D (20,000 signals generated offline, batch 400, 10 epochs, epsilon 4),
# train the planner's mechanism and DP-SGD at the same budget, print both accuracies and the privacy
# spent, and write the plots to out/. About 75 s on the 2-core machine, quiet (batch 400: 50 bins,
# so the planner's one Monte Carlo verification costs ~35 s; batch 200 took 153 s).
run: install
	$(VENV)/bin/corrnoise train --dataset mnist1d --mechanism auto --compare dpsgd --epsilon 4 --delta 1e-5 \
		--batch-size 400 --epochs 10 --plot out/mnist1d.png

test: install-test
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n 2 tests

# The noise and structured-linear-algebra tests again, under other CPU kernels than `make test`'s
# (OpenBLAS core type, ATen CPU capability, MKL instruction set, numpy's SIMD dispatch; see
# .ci/other_kernels.py): a test pinned to one kernel's rounding fails here, not on the next CPU
# (docs/design.md, "What is reproducible, and where"). Under a minute on 2 cores.
KERNEL_TESTS := tests/test_noise.py tests/test_noise_counters.py tests/test_distributed.py tests/test_blt.py \
	tests/test_tree.py tests/test_bandinv.py tests/test_bisr.py tests/test_linalg_toeplitz.py tests/test_strategies.py
test-kernels: install-test
	$(PY) .ci/other_kernels.py $(PY) -m pytest -q -n 2 -m "not slow" $(KERNEL_TESTS)

# Fashion-MNIST for `corrnoise.datasets` without root and without touching the system: fetch
# Debian's dataset-fashion-mnist .deb with apt-get download (the only network access; the
# loaders never download) and unpack it into .data/ (.data/usr/share/datasets/fashion-mnist).
# Elsewhere: put the four (.gz) IDX files in $$CORRNOISE_DATA/fashion-mnist instead.
DATA_DIR := .data
FASHION_DIR := $(DATA_DIR)/usr/share/datasets/fashion-mnist
data: $(FASHION_DIR)/t10k-labels-idx1-ubyte.gz

$(FASHION_DIR)/t10k-labels-idx1-ubyte.gz:
	@if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then \
	  echo "make data: apt-get/dpkg not found. Put train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,"; \
	  echo "  t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz (Fashion-MNIST) in \$$CORRNOISE_DATA/fashion-mnist"; \
	  exit 1; \
	fi
	@tmp=$$(mktemp -d) && chmod 755 "$$tmp" && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && apt-get download dataset-fashion-mnist) || { \
	    echo "make data: 'apt-get download dataset-fashion-mnist' failed; run 'apt-get update' (as root) and retry,"; \
	    echo "  or put the four Fashion-MNIST IDX files in \$$CORRNOISE_DATA/fashion-mnist"; exit 1; } && \
	  mkdir -p $(DATA_DIR) && dpkg -x "$$tmp"/dataset-fashion-mnist_*.deb $(DATA_DIR) && \
	  ls -l $(FASHION_DIR)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
