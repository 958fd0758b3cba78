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
#
# Bytecode: pip compiles every installed file on one core after each install (~60 s of a ~2-minute set-up,
# most of it for files nothing imports). Instead torch's files compile on the second core while pip installs
# the rest, and then two imports of what phalanx's commands and the tests use write the rest's caches (with
# PYTHONDONTWRITEBYTECODE, which some shells set, a file with no cache is compiled again at every import).
# torch's py312_intrinsics.py is Python 3.12 syntax that no 3.11 import reads. The venv's own pip is used as
# it comes (Python 3.10's or newer installs an editable pyproject package): upgrading it cost a download.
EXTRAS ?= dev,examples,trainers,log
WARM_IMPORTS ?= "torch._dynamo, torch.distributed.run, phalanx.cli, tqdm" \
	"matplotlib.pyplot, sklearn.datasets, sklearn.model_selection, sklearn.preprocessing, lightning, accelerate, tensorboardX"
# Imports each of argv[1]'s comma-separated modules whose package is installed (the extras are optional).
export IMPORT_PRESENT := import importlib, importlib.util, sys; \
	[importlib.import_module(m) for m in sys.argv[1].split(", ") if importlib.util.find_spec(m.split(".")[0])]
$(STAMP): pyproject.toml setup.py phalanx/shm/_reduce_kernels.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m compileall -q -x 'py31[2-9]_' "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')" \
		> $(VENV)/compileall.log & compiling=$$!; \
	$(PY) -m pip install -q --no-compile -e ".[$(EXTRAS)]" && wait $$compiling
	for modules in $(WARM_IMPORTS); do env -u PYTHONDONTWRITEBYTECODE $(PY) -c "$$IMPORT_PRESENT" "$$modules" & done; wait
	touch $(STAMP)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
