# Everything runs in a local virtual environment (.venv); `make demo` and `make test` set it up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Dev and CI machines have no GPU: pin the CPU build of torch that lies on their disk. On a
# machine without it, pass any pip spec, e.g. TORCH_SPEC="torch --index-url <PyTorch CPU index>".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.autoprec-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(TORCH_SPEC)
	# hold that torch: a dependency asking for another one makes pip take an older release of
	# the dependency (or fail, saying so) instead of replacing torch with a multi-GB CUDA build
	$(BIN)/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install -q --no-compile -c $(VENV)/torch-constraint.txt -e '.[dev]'
	# bytecode for what pip installed, on every core (pip compiles file by file: setup took
	# 139 s, 100-114 s this way); like pip, it goes on past a file written for a newer Python
	# (torch ships one): its exit status is not the setup's, and missing bytecode only costs time
	$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/autoprec tune examples.tiny_gpt:make_model --data examples.tiny_gpt:make_batches --budget 1 --out runs/tiny_gpt.json

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# one pytest worker per core (pytest-xdist), each training on one thread (tests/conftest.py):
# 6.4-11.0 minutes on our 2-core CPU (docs/development.md: 9.3-15.0 before the suite froze
# its objects out of the collector's walks), 29.7 once in one process
test: lint
	$(BIN)/python -m pytest -n auto --dist loadgroup

bench: setup
	$(BIN)/python -m benchmarks.probe_time
	$(BIN)/python -m benchmarks.plan_overhead
	$(BIN)/python -m benchmarks.drift_gate
	$(BIN)/python -m benchmarks.decision_quality
	$(BIN)/python -m benchmarks.lr_schedule_gate

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
