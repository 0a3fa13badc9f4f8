# Two entry points (README): `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: run test install install-test clean

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

# The main job: plan and calibrate every mechanism for (epsilon=8, delta=1e-5) on scikit-learn's
# bundled digits data, train with the best one and report accuracy and the privacy spent.
run: install
	$(VENV)/bin/corrnoise train --dataset digits --mechanism auto --epsilon 8 --delta 1e-5

test: install-test
	$(PY) -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
