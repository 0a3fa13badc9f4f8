# Two entry points (README): `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: run test test-kernels install install-test clean data bench-text

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

$(VENV)/.installed-transformers: $(VENV)/.installed
	$(PIP) install -q -e '.[transformers]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job: plan for MNIST-1D (20,000 signals generated offline, batch 400, 10 epochs, epsilon 4),
# train the planner's mechanism and DP-SGD at the same budget, print both accuracies and the privacy
# spent, and write the plots to out/. 75-120 s on the 2-core machines, talkative on stderr (batch 400: 50
# bins, so the planner's one Monte Carlo verification costs 35-55 s when it picks a balls-in-bins candidate;
# batch 200 took 153 s).
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

# Datasets for `corrnoise.datasets` without root and without touching the system: fetch Debian
# .debs with apt-get download (the only network access; the loaders never download) and unpack
# them into .data/ (dpkg -x). Elsewhere: put the files in $$CORRNOISE_DATA instead (see each loader).
#   dataset-fashion-mnist -> .data/usr/share/datasets/fashion-mnist  (or $$CORRNOISE_DATA/fashion-mnist)
#   fortunes              -> .data/usr/share/games/fortunes           (or $$CORRNOISE_DATA/fortunes)
#   dict-gcide            -> .data/usr/share/dictd/gcide.dict.dz      (or $$CORRNOISE_DATA/gcide.dict.dz)
# fortunes: fortune-mod's ~40 category files, the private fine-tuning text of `make bench-text`;
# dict-gcide: the GNU Collaborative International Dictionary of English (Webster's 1913, public
# domain, plus additions; GPL), ~40 MB of English, its public pretraining text.
DATA_DIR := .data
FASHION_DIR := $(DATA_DIR)/usr/share/datasets/fashion-mnist
FORTUNES_DIR := $(DATA_DIR)/usr/share/games/fortunes
GCIDE_FILE := $(DATA_DIR)/usr/share/dictd/gcide.dict.dz
data: $(FASHION_DIR)/t10k-labels-idx1-ubyte.gz $(FORTUNES_DIR)/people $(GCIDE_FILE)

, := ,
# $(call unpack_deb,PACKAGE,WHAT TO PUT IN $$CORRNOISE_DATA BY HAND,PATH TO LIST)
define unpack_deb
	@if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then \
	  echo "make data: apt-get/dpkg not found. Put $(2)"; exit 1; \
	fi
	@tmp=$$(mktemp -d) && chmod 755 "$$tmp" && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && apt-get download $(1)) || { \
	    echo "make data: 'apt-get download $(1)' failed; run 'apt-get update' (as root) and retry,"; \
	    echo "  or put $(2)"; exit 1; } && \
	  mkdir -p $(DATA_DIR) && dpkg -x "$$tmp"/$(1)_*.deb $(DATA_DIR) && \
	  ls -ld $(3)
endef

$(FASHION_DIR)/t10k-labels-idx1-ubyte.gz:
	$(call unpack_deb,dataset-fashion-mnist,train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz (Fashion-MNIST) in \$$CORRNOISE_DATA/fashion-mnist,$(FASHION_DIR))

$(FORTUNES_DIR)/people:
	$(call unpack_deb,fortunes,the fortune category files (people$(,) definitions ...) in \$$CORRNOISE_DATA/fortunes,$(FORTUNES_DIR))

$(GCIDE_FILE):
	$(call unpack_deb,dict-gcide,gcide.dict.dz in \$$CORRNOISE_DATA,$(GCIDE_FILE))

# Issue #27 item 7: public pretraining on GCIDE, private fine-tuning on fortunes (10 categories),
# non-private vs DP-SGD (Poisson, cyclic) vs the planner's pick, full and LoRA, epsilon 1, 3, 8;
# appends to benchmarks/text_runs.jsonl, then the table (stdout) and benchmarks/text.png.
# ~25 min on the 2-core machine at load 2, 42 min when others' jobs raised the load to 8-10
# (BENCH_TEXT_ARGS="--seeds 3" for the issue's three seeds, ~3x; "--runs ..." for a subset).
BENCH_TEXT_ARGS ?=
bench-text: $(VENV)/.installed-transformers data
	PYTHONPATH=src nice -n 10 $(PY) benchmarks/bench_text.py $(BENCH_TEXT_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
