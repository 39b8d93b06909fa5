# vitrieval: `make test` and `make demo` each create the virtualenv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_RUN ?= runs/demo
DEMO_PORT ?= 8000
DEMO_HOST := 127.0.0.1
PYTEST_ARGS ?=
# the serving install of check-serve-install: the base dependencies and the serve extra
SERVE_VENV ?= .venv-serve

.PHONY: install test test-slow lint format check-serve-install demo demo-port demo-clean bench bench-search \
	compose-config clean

# The tested versions of constraints.txt, within the ranges of pyproject.toml; the stamp
# is rebuilt whenever either changes.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e '.[train,serve,dev,distributed]'
	touch $@

install: $(VENV)/.installed

# The suite but the tests marked slow (minutes each: `make test-slow` runs those);
# tests/test_serve_install.py runs its commands in the serving install.
test: install $(SERVE_VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	VITRIEVAL_SERVE_PYTHON=$(abspath $(SERVE_VENV))/bin/python $(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: install $(SERVE_VENV)/.installed
	VITRIEVAL_SERVE_PYTHON=$(abspath $(SERVE_VENV))/bin/python $(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# A second virtualenv as `pip install -c constraints.txt -e '.[serve]'` makes it, without
# torch, built from scratch whenever pyproject.toml or constraints.txt changes (about 20 s
# from pip's cache). check-serve-install builds, indexes, benchmarks and serves with it:
# tests/test_serve_install.py, whose commands run with its Python (the test process itself,
# which exports the model, runs in $(VENV)). Without VITRIEVAL_SERVE_PYTHON the same test
# runs them in $(VENV) with every package the serving install lacks made unimportable.
$(SERVE_VENV)/.installed: pyproject.toml constraints.txt
	rm -rf $(SERVE_VENV)
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -c constraints.txt -e '.[serve]'
	touch $@

check-serve-install: install $(SERVE_VENV)/.installed
	VITRIEVAL_SERVE_PYTHON=$(abspath $(SERVE_VENV))/bin/python $(BIN)/python -m pytest tests/test_serve_install.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# `make demo` picks up where the last one stopped: the run resumes from its checkpoint (a
# finished run says "already finished" and touches nothing), and the export, the held-out
# images, the index and the benchmark are redone only when older than what they are made
# from. `make demo-clean` removes the demo run, to start over.
demo: demo-port install $(DEMO_RUN)/index/build_report.json $(DEMO_RUN)/bench/report.json
	$(BIN)/vitrieval-index search $(DEMO_RUN)/index $(DEMO_RUN)/images/7/digits_00017.png -k 5
	@echo "demo: model $(DEMO_RUN)/model.onnx, index $(DEMO_RUN)/index, curves $(DEMO_RUN)/curves.png"
	@echo "demo: search page at http://$(DEMO_HOST):$(DEMO_PORT)/ , API docs at /docs (Ctrl-C stops the server)"
	$(BIN)/vitrieval-serve --model $(DEMO_RUN)/model.onnx --index $(DEMO_RUN)/index \
		--host $(DEMO_HOST) --port $(DEMO_PORT) --read-only

# The server's port, checked first: taken, it would otherwise show only after minutes of
# training, as the server's error, which knows nothing of DEMO_PORT. The server sets
# SO_REUSEADDR as well, so a port that only lingers after a server stopped passes.
demo-port:
	@$(PYTHON) -c "import socket; s = socket.socket(); \
		s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); \
		s.bind(('$(DEMO_HOST)', int('$(DEMO_PORT)')))" 2>/dev/null || { \
		echo "make demo: port $(DEMO_PORT) on $(DEMO_HOST) is in use or invalid;" \
			"choose another: make demo DEMO_PORT=$$(( $(DEMO_PORT) + 1 ))" >&2; exit 1; }

# Training runs every time (FORCE), resuming when the run has a checkpoint: fit --resume
# needs one, and a run stopped before its first checkpoint starts over. model.safetensors
# changes only when an epoch ends, so what is made from it is redone only then; a
# finished run says "already finished" and touches nothing. DEMO_FIT_ARGS adds fit
# options (e.g. DEMO_FIT_ARGS='--epochs 2' for a short demo; a resume keeps the saved ones).
DEMO_FIT_ARGS ?=
DEMO_FIT = $(if $(wildcard $(DEMO_RUN)/checkpoint/state.json),--out $(DEMO_RUN) --resume,\
	--dataset digits --preset tiny --out $(DEMO_RUN)) $(DEMO_FIT_ARGS)
# What the line of a stopped fit names as the command that continues it
# (training/interrupt.py's VITRIEVAL_RESUME_COMMAND): `make demo`, with DEMO_RUN when
# it was given.
DEMO_RESUME = make demo$(if $(filter command line environment,$(origin DEMO_RUN)), DEMO_RUN=$(DEMO_RUN))

$(DEMO_RUN)/model.safetensors: install FORCE
	VITRIEVAL_RESUME_COMMAND='$(DEMO_RESUME)' $(BIN)/vitrieval-train fit $(strip $(DEMO_FIT))

$(DEMO_RUN)/model.onnx: $(DEMO_RUN)/model.safetensors
	$(BIN)/vitrieval-train export --run $(DEMO_RUN) --out $@

$(DEMO_RUN)/images/list.csv: | install
	$(BIN)/vitrieval-index export-dataset --dataset digits --split test --out $(DEMO_RUN)/images

# build_report.json is written last; an index of an older model is rebuilt from scratch
$(DEMO_RUN)/index/build_report.json: $(DEMO_RUN)/model.onnx $(DEMO_RUN)/images/list.csv
	rm -rf $(DEMO_RUN)/index
	$(BIN)/vitrieval-index build --model $(DEMO_RUN)/model.onnx --images $(DEMO_RUN)/images \
		--labels-from-folders --out $(DEMO_RUN)/index

$(DEMO_RUN)/bench/report.json: $(DEMO_RUN)/model.onnx $(DEMO_RUN)/images/list.csv
	$(BIN)/vitrieval-index bench --model $(DEMO_RUN)/model.onnx --gallery $(DEMO_RUN)/images/list.csv \
		--out $(DEMO_RUN)/bench

# Ctrl-C deletes a target whose file changed since its recipe started, unless precious:
# model.safetensors changes every epoch and is the run's weights (the checkpoint that
# --resume reads stays anyway), and every other file here is written atomically, so
# none is ever a partial file worth deleting.
.PRECIOUS: $(DEMO_RUN)/model.safetensors $(DEMO_RUN)/model.onnx $(DEMO_RUN)/images/list.csv \
	$(DEMO_RUN)/index/build_report.json $(DEMO_RUN)/bench/report.json

demo-clean:
	rm -rf $(DEMO_RUN)

FORCE:

# The benchmarks of docs/benchmarks.md; int8 needs the demo model (`make demo` first),
# bench-search takes about 10 minutes on 2 cores.
bench: install
	$(BIN)/python bench/pooling_step.py --preset small --steps 10 --rounds 5
	$(BIN)/python bench/second_order.py --preset small --steps 5 --rounds 5
	$(BIN)/python bench/embedder_throughput.py --images 512 --rounds 3
	$(BIN)/python bench/int8_vs_fp32.py --model $(DEMO_RUN)/model.onnx
	$(BIN)/python bench/serve_load.py --rounds 2

bench-search: install
	$(BIN)/python bench/search_qps.py --latency 100

# docker-compose.yml as docker-compose reads it, every profile (docs/deploy.md);
# needs only the docker-compose binary, no Docker engine
compose-config:
	docker-compose -f docker-compose.yml --profile gpu --profile jobs --profile gpu-jobs config -q
	@echo "docker-compose.yml: valid"

clean:
	rm -rf $(VENV) $(SERVE_VENV) runs .pytest_cache
