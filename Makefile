# vitrieval: `make test` and `make demo` each create the virtualenv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_RUN ?= runs/demo
PYTEST_ARGS ?=

.PHONY: install test lint format demo bench clean

# The stamp is rebuilt whenever pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[train,serve,dev]'
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: install
	rm -rf $(DEMO_RUN)
	$(BIN)/vitrieval-train fit --dataset digits --preset tiny --out $(DEMO_RUN)
	$(BIN)/vitrieval-train export --run $(DEMO_RUN) --out $(DEMO_RUN)/model.onnx
	@echo "demo model: $(DEMO_RUN)/model.onnx (training curves: $(DEMO_RUN)/curves.png)"

bench: install
	$(BIN)/python bench/pooling_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache
