# The two commands a new user needs: `make demo` and `make test`. Each installs what it
# needs first: the virtualenv (.venv) and, for the tests, docker-compose and bubblewrap.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
# The demo stops on its own after 300 trainer steps (about 3 minutes on 2 cores, by which
# the built-in task is learned); DEMO_ARGS= runs until Ctrl-C.
DEMO_ARGS ?= --max-trainer-steps 300
PYTEST_ARGS ?=

.PHONY: demo test test-slow bench lint schema venv system-tools clean

venv: $(INSTALLED)

# Reinstalled when pyproject.toml changes. torch==2.13.0 is the CPU build on this kind of
# machine; see README for the CUDA install.
$(INSTALLED): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"Python >= 3.11 needed, found {sys.version.split()[0]}: set PYTHON=/path/to/python3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(INSTALLED)

system-tools:
	@bash scripts/ensure_system_tools.sh

demo: $(INSTALLED)
	$(BIN)/rlpipe demo $(DEMO_ARGS)

# `make test` keeps under 15 minutes on 2 quiet cores: two workers, the whole-pipeline tests
# one after another on one of them (tests/marks.py), and the tests marked slow left out (each
# over a minute: the Ray deployment, the NATS cluster and chaos runs, the agent RL runs);
# `make test-slow` runs those, one at a time. No test times itself (speed is bench/'s): beside
# other work the suite takes longer and still passes.
test: $(INSTALLED) system-tools
	$(BIN)/python -m pytest -m "not slow" -n 2 --dist loadgroup $(PYTEST_ARGS)

test-slow: $(INSTALLED) system-tools
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# Each benchmark overwrites its JSON in bench/results/<machine>/ (vm here unless BENCH_MACHINE).
bench: $(INSTALLED)
	$(BIN)/python bench/bus_bench.py
	$(BIN)/python bench/weights_codec_bench.py
	$(BIN)/python bench/weights_codec_bench.py --lr 5e-4 --out bench/results/$${BENCH_MACHINE:-vm}/weights_codec_dense.json
	$(BIN)/python bench/weights_transport_bench.py
	$(BIN)/python bench/weights_relay_bench.py
	$(BIN)/python bench/sandbox_bench.py
	$(BIN)/python bench/agentic_bench.py
	$(BIN)/python bench/feedback_bench.py
	$(BIN)/python bench/pipeline_bench.py
	$(BIN)/python bench/batcher_bench.py
	$(BIN)/python bench/serve_flood_bench.py

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

schema: $(INSTALLED)
	$(BIN)/python -m proto.schema

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
