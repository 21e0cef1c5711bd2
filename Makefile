# Every target installs what it needs into .venv first, so a fresh clone works with one command.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench model model-base model-heads model-drafter clean

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

# Every benchmark with the published arguments (benchmarks/suite.py), JSON and plots into benchmarks/results,
# then BENCHMARKS.md rendered from them. About 50 minutes on 2 cores; `dspark-router bench all --only NAME` for one.
bench: $(STAMP)
	$(BIN)/dspark-router bench all

# dspark-mini, base first, in four stages of one schedule (3,600 steps, each stage resuming the last):
# synthetic copy rows of 32 then 256 tokens, where the copying circuit forms in a few hundred steps; then text
# (subtasks, copy and schema drills, code, prose) with some copy rows kept, in rows of 512 then 1,024 tokens.
# Then two drafters trained on the frozen base, independent of each other (`make -j2 model` runs them side by
# side, one core each): span heads on the base model's own greedy continuations (self-distillation) and the
# published DSpark drafter; then thresholds tuned by measured speed, a small draft model on the same tokenizer
# (the assisted-generation contender of `bench decode`), the cost profile, and the classifier's measurements
# and calibration on the new model.
MODEL_DIR := models/dspark-mini
BASE := runs/dspark-mini-base
BASE_ARGS := --mode scratch --output $(BASE) --num-heads 0 --context 1024 --vocab-size 2048 --hidden 192 \
	--layers 4 --lr 1e-3 --warmup 100 --chat-examples 40000 --checkpoint-every 100 --steps 3600
DRILL_MIX := --mix 0.35,0.4,0.15,0.1
RESUME := --tokenizer $(BASE)/checkpoint
DRAFTER_THREADS ?= 1
# A file target, so that `make model` after an interrupted session trains only what is missing (each training
# command also resumes from its own checkpoint).
model-base: $(BASE)/.trained
$(BASE)/.trained: | $(STAMP)
	$(BIN)/dspark-router train $(BASE_ARGS) $(DRILL_MIX) --batch-size 64 --seq-len 32 --induction-rows 1 --stop-at 700
	$(BIN)/dspark-router train $(BASE_ARGS) $(DRILL_MIX) $(RESUME) --batch-size 8 --seq-len 256 --induction-rows 1 \
		--stop-at 1000
	$(BIN)/dspark-router train $(BASE_ARGS) $(DRILL_MIX) $(RESUME) --batch-size 8 --seq-len 512 --induction-rows 0.25 \
		--stop-at 2200
	$(BIN)/dspark-router train $(BASE_ARGS) --mix 0.5,0.25,0.15,0.1 $(RESUME) --batch-size 8 --seq-len 1024 \
		--induction-rows 0.125
	touch $@

model-heads: model-base
	$(BIN)/dspark-router train --mode heads --model $(BASE) --output $(MODEL_DIR) --steps 500 \
		--batch-size 16 --lr 2e-3 --self-distill 2000 --distill-tokens 96 --threads $(DRAFTER_THREADS)
	rm -rf $(MODEL_DIR)/checkpoint
	cp $(BASE)/train_report_scratch.json $(BASE)/train_curve_scratch.png $(MODEL_DIR)/
	$(BIN)/dspark-router train --mode heads --model $(MODEL_DIR) --output $(MODEL_DIR) --steps 700 \
		--batch-size 16 --lr 1e-3 --warmup 20 --self-distill 2000 --distill-tokens 96 --seed 1 \
		--threads $(DRAFTER_THREADS)
	$(BIN)/dspark-router train --mode scratch --output $(MODEL_DIR)-draft --tokenizer $(MODEL_DIR) --steps 500 \
		--batch-size 12 --seq-len 256 --hidden 96 --layers 2 --num-heads 1 --lr 3e-3 --chat-examples 20000 \
		--threads $(DRAFTER_THREADS)

model-drafter: model-base
	$(BIN)/dspark-router train --drafter dspark --model $(BASE) --output $(MODEL_DIR)/dspark_drafter \
		--steps 2000 --self-distill 2000 --anchors 32 --threads $(DRAFTER_THREADS)

model: model-heads model-drafter
	$(BIN)/dspark-router tune --model $(MODEL_DIR) --write
	$(BIN)/python -m backends.dspark.profile $(MODEL_DIR)
	$(BIN)/dspark-router calibrate --model $(MODEL_DIR) --max-tokens 96
	rm -rf $(MODEL_DIR)/checkpoint $(MODEL_DIR)-draft/checkpoint $(MODEL_DIR)/dspark_drafter/checkpoint \
		$(MODEL_DIR)/dspark_drafter/distillation.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
