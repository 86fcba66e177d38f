# Set-up and the two everyday commands. `make demo` and `make test` each install
# what they need into .venv first (once; again when pyproject.toml changes).
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
# CPU machines: the CPU build of torch (pin it so pip never pulls a multi-GB CUDA build).
# On a machine that already has the torch it wants, use `make TORCH= ...`.
TORCH  ?= torch==2.13.0

.PHONY: demo test gpu-test clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install -q $(TORCH))
	$(BIN)/python -m pip install -q -e '.[adios,test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/insitu demo --out demo_out

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n auto

gpu-test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m gpu

clean-venv:
	rm -rf $(VENV)
