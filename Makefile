# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phalanx-installed

.PHONY: demo test test-quick lint install bench bench-all clean

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

# Every CPU scenario of benchmarks/ at a size for 2 cores (under 20 minutes), one after the other, into
# bench-results/suite.json and suite.md; `--only NAME,...` reruns some (docs/benchmarks.md "Running").
bench-all: $(STAMP)
	$(VENV)/bin/phalanx bench --suite cpu

install: $(STAMP)

# torch goes in first and pinned: an unpinned resolve would pull the CUDA build. The trainers extra
# (Accelerate, Lightning: pinned, and accepting this torch) is for the tests marked `trainers`, which CI
# runs; `make install EXTRAS=dev,examples` leaves it out (those tests then skip: -m "not trainers"). The log
# extra (tensorboardX) is for StepLog's TensorBoard files; without it the tests that read them skip.
#
# Set-up time (measured on 2 cores: ~90 s with pip alone, ~45 s this way):
# - The venv is made without pip (ensurepip: 9 s); this machine's pip works on it (`--python`, pip >= 22.3),
#   or, where that pip cannot, the venv gets its own. uv gives the venv its pip in the end (in 1 s: a user's
#   `pip install` in the activated venv must not reach the system's Python).
# - pip fetches torch's wheel, so that pip's configuration (a local file, an index, a constraint) decides
#   where torch comes from; uv installs it and the extras (in parallel, from its own cache: the extras in
#   ~11 s, 50 s with pip), with torch held at the installed version so that no extra can replace it.
# - Bytecode: torch's files compile on the second core while the extras install, and then (while torch's
#   last files compile) two imports of what phalanx's commands and the tests use write the rest's caches
#   (with PYTHONDONTWRITEBYTECODE, which some shells set, a file with no cache is compiled again at every
#   import). torch's py312_intrinsics.py is Python 3.12 syntax that no 3.11 import reads.
EXTRAS ?= dev,examples,trainers,log
WARM_IMPORTS ?= "torch._dynamo, torch.distributed.run, phalanx.cli, tqdm" \
	"matplotlib.pyplot, sklearn.datasets, sklearn.model_selection, sklearn.preprocessing, lightning, accelerate, tensorboardX"
# Imports each of argv[1]'s comma-separated modules whose package is installed (the extras are optional).
export IMPORT_PRESENT := import importlib, importlib.util, sys; \
	[importlib.import_module(m) for m in sys.argv[1].split(", ") if importlib.util.find_spec(m.split(".")[0])]
UV := $(VENV)/bin/uv pip install -q --python $(PY)
WHEELS := $(VENV)/wheels
$(STAMP): pyproject.toml setup.py phalanx/shm/_reduce_kernels.c
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	rm -rf $(WHEELS); pip="$(PYTHON) -m pip --python $(PY)"; \
	$$pip --version > /dev/null 2>&1 || { $(PY) -m ensurepip -q && pip="$(PY) -m pip"; }; \
	$$pip install -q uv & getting_uv=$$!; $$pip download -q --no-deps -d $(WHEELS) "$(TORCH_SPEC)" && wait $$getting_uv
	$(UV) $(WHEELS)/torch-*.whl && rm -rf $(WHEELS)
	$(PY) -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' > $(VENV)/torch-pin.txt
	$(PY) -m compileall -q -x 'py31[2-9]_' "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')" \
		> $(VENV)/compileall.log & compiling=$$!; \
	$(UV) --constraint $(VENV)/torch-pin.txt pip -e ".[$(EXTRAS)]" && \
	for modules in $(WARM_IMPORTS); do env -u PYTHONDONTWRITEBYTECODE $(PY) -c "$$IMPORT_PRESENT" "$$modules" & done && \
	wait $$compiling && wait
	touch $(STAMP)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
