# steadylm: `make help` lists the targets. Every target creates the environment it needs.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Without an NVIDIA driver, pin the CPU-tested torch; with one, let pip pick the user's CUDA build.
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch>=2.6,torch==2.13.0)
RUN ?=
ARGS ?=

.DEFAULT_GOAL := help

help: ## show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

# The dev extra (pytest, ruff, transformers for the export tests, ...): only what tests, lint and bench need.
$(VENV)/.dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.dev ## create .venv and install steadylm with dev extras

DEMO_DATA := data/stdlib-bpe/tokenizer.json

data: $(VENV)/.installed ## tokenize the embedded corpus (stdlib sources) into HDF5 shards under data/ (ARGS="data.input=...")
	$(PY) -m steadylm.data.prepare $(ARGS)

$(DEMO_DATA): | $(VENV)/.installed
	$(PY) -m steadylm.data.prepare experiment=demo

demo: $(VENV)/.installed $(DEMO_DATA) ## fresh clone -> a BPE trained on the embedded corpus, a tiny model trained on it, TensorBoard logs, checkpoint, samples, report
	rm -rf logs/demo
	$(PY) train.py experiment=demo hydra.run.dir=logs/demo $(ARGS)
	$(PY) -m steadylm.generate ckpt=logs/demo/checkpoints/last.ckpt 'prompt="def "' max_new_tokens=80
	$(PY) -m steadylm.diagnose logs/demo
	@echo "demo done: logs/demo (make tensorboard RUN=logs/demo)"

# Both suites run on JOBS pytest-xdist workers: their tests pin torch to one thread each (conftest), so one
# worker leaves a core idle. The slow suite on 2 workers: 11:47 against 19:22 serial on 2 cores, though its
# DDP runs start two processes each (most of a DDP test is start-up, not compute).
JOBS ?= 2
test: $(VENV)/.dev ## run the fast test suite (a few minutes on 2 cores; JOBS=1 for one worker)
	$(PY) -m pytest -q -n $(JOBS) --durations=15 $(ARGS)

test-slow: $(VENV)/.dev ## run only the slow tests (survival of every fault, false-alarm sweep, DDP, sweeps)
	$(PY) -m pytest -q -m slow -n $(JOBS) --durations=15 $(ARGS)

lint: $(VENV)/.dev ## ruff: lint and format check (pre-commit runs the same)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# A lent GPU machine's image has torch, lightning and h5py but not Hydra, and no network: carry these with the call.
gpu-wheels: ## download what benchmarks/gpu.sh needs on a GPU image without Hydra into .gpu-wheels/ (carry it)
	python3 -m pip wheel -q -w .gpu-wheels --no-deps hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3

doctor: $(VENV)/.installed ## preflight checks with the same overrides as train.py (ARGS="model=small ...")
	$(PY) -m steadylm.doctor $(ARGS)

diagnose: $(VENV)/.installed ## report of a run directory: make diagnose RUN=logs/train/runs/...
	$(PY) -m steadylm.diagnose $(RUN)

generate: $(VENV)/.installed ## sample from a run's last checkpoint: make generate RUN=logs/demo ARGS='prompt="def "'
	$(PY) -m steadylm.generate ckpt=$(RUN)/checkpoints/last.ckpt $(ARGS)

tensorboard: $(VENV)/.installed ## serve a run (or sweep) dir on 127.0.0.1: make tensorboard RUN=logs/demo
	$(VENV)/bin/tensorboard --logdir $(RUN) --host 127.0.0.1

BENCHES := bench.py model_bench.py snapshot_bench.py qk_clip_bench.py prepare_bench.py head_loss_bench.py \
	checkpoint_save_bench.py

bench: $(VENV)/.dev ## side-by-side ratios: training overhead, Llama vs GPT, snapshots, FSDP2 checkpoint stall, prepare MB/s, head+loss memory, Muon's step cost (ARGS=--quick)
	@for b in $(BENCHES); do echo "== benchmarks/$$b"; $(PY) benchmarks/$$b $(ARGS) || exit 1; done
	@echo "== benchmarks/time_to_loss.py --step-cost"; $(PY) benchmarks/time_to_loss.py --step-cost $(ARGS)

clean: ## remove logs and caches (keeps data/ and .venv)
	rm -rf logs outputs multirun .pytest_cache

.PHONY: help install data demo test test-slow lint doctor diagnose generate tensorboard bench clean
