# Every target installs what it needs into .venv first, so a fresh clone works with one command.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench model clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the CPU build lies on local disk; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The agent example through the REST gateway: `dspark-router serve` on a free loopback port, the openai SDK as client.
demo: $(STAMP)
	$(BIN)/python examples/agent_pipeline.py --gateway

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/dspark-router bench decode --json bench-results/decode.json

# dspark-mini: base and heads jointly from scratch in two stages (subtasks, code and prose; then with copy drills
# added, resumed on the same schedule), then fresh heads on the base model's own greedy continuations
# (self-distillation), thresholds tuned by measured speed; and a small draft model on the same tokenizer for
# the transformers assisted-generation contender of `bench decode`.
MODEL_DIR := models/dspark-mini
BASE := runs/dspark-mini-base
BASE_ARGS := --mode scratch --output $(BASE) --batch-size 8 --seq-len 1024 --context 1024 --vocab-size 2048 \
	--hidden 256 --layers 4 --lr 1e-3 --warmup 200 --chat-examples 40000 --checkpoint-every 100
model: $(STAMP)
	$(BIN)/dspark-router train $(BASE_ARGS) --steps 1300 --stop-at 900 --mix 0.6,0,0.25,0.15
	$(BIN)/dspark-router train $(BASE_ARGS) --steps 1900 --mix 0.5,0.25,0.15,0.1 --tokenizer $(BASE)/checkpoint
	$(BIN)/dspark-router train --mode heads --model $(BASE) --output $(MODEL_DIR) --steps 500 \
		--batch-size 16 --lr 2e-3 --self-distill 2000 --distill-tokens 96
	rm -rf $(MODEL_DIR)/checkpoint
	$(BIN)/dspark-router train --mode heads --model $(MODEL_DIR) --output $(MODEL_DIR) --steps 700 \
		--batch-size 16 --lr 1e-3 --warmup 20 --self-distill 2000 --distill-tokens 96 --seed 1
	$(BIN)/dspark-router tune --model $(MODEL_DIR) --write
	$(BIN)/dspark-router train --mode scratch --output $(MODEL_DIR)-draft --tokenizer $(MODEL_DIR) --steps 500 \
		--batch-size 12 --seq-len 256 --hidden 96 --layers 2 --num-heads 1 --lr 3e-3 --chat-examples 20000
	rm -rf $(MODEL_DIR)/checkpoint $(MODEL_DIR)-draft/checkpoint

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
