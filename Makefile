# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phalanx-installed

.PHONY: demo test test-quick lint install bench clean

demo: $(STAMP)
	$(VENV)/bin/phalanx demo

# The whole suite in stages run side by side (tests/suite.py), then its slowest tests and the total.
# Which tier to run when, and each tier's time budget: CONTRIBUTING.md.
test: $(STAMP)
	$(PY) -m tests.suite

# The unit tier and one smoke test per capability: at most 2 minutes.
test-quick: $(STAMP)
	$(PY) -m tests.suite --quick

# The rule set and why it was chosen: [tool.ruff] in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/phalanx bench

install: $(STAMP)

# torch goes in first and pinned: an unpinned resolve would pull the CUDA build. The trainers extra
# (Accelerate, Lightning: pinned, and accepting this torch) is for the tests marked `trainers`, which CI
# runs; `make install EXTRAS=dev,examples` leaves it out (those tests then skip: -m "not trainers"). The log
# extra (tensorboardX) is for StepLog's TensorBoard files; without it the tests that read them skip.
EXTRAS ?= dev,examples,trainers,log
$(STAMP): pyproject.toml setup.py phalanx/shm/_reduce_kernels.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
