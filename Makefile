# The two commands (see README.md):
#   make demo   -> set up .venv and run the main job (2-rank DLRM, delta checkpoints, verified restore)
#   make test   -> set up .venv and run the test suite
# GPU machines: make VARIANT=gpu ... installs fbgemm-gpu (CUDA) instead of fbgemm-gpu-cpu.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
VARIANT   ?= cpu
TORCH     := torch==2.13.0
FBGEMM_cpu := fbgemm-gpu-cpu==1.8.0
FBGEMM_gpu := fbgemm-gpu==1.8.0
TORCHREC  := torchrec==1.8.0
STAMP     := $(VENV)/.deck-installed-$(VARIANT)

.PHONY: install demo test test-fast fuzz fuzz-ops fuzz-kafka fuzz-gc long lint ruff mypy bench clean

$(STAMP): pyproject.toml Makefile kernels/_native.c
	@echo "deck install: setting up $(VENV) (5 steps; about 1 GB to download, several minutes the first time)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "deck install [1/5]: $(TORCH) (the largest download)"
	$(BIN)/pip install --progress-bar on $(TORCH)
	@echo "deck install [2/5]: $(FBGEMM_$(VARIANT))"
	$(BIN)/pip install -q numpy $(FBGEMM_$(VARIANT))
	@echo "deck install [3/5]: $(TORCHREC) without its dependencies (its wheel asks for the CUDA fbgemm-gpu)"
	$(BIN)/pip install -q --no-deps $(TORCHREC)
	@echo "deck install [4/5]: TorchRec's other dependencies"
	@echo "  (pip may print 'torchrec ... requires fbgemm-gpu, which is not installed' in red from here on:"
	@echo "   expected and harmless, $(FBGEMM_$(VARIANT)) provides the same module)"
	$(BIN)/pip install -q tensordict torchmetrics==1.0.3 tqdm pyre-extensions
	@echo "deck install [5/5]: deck itself (editable, compiles kernels/_native.c) and its test tools"
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)
	@echo "deck install: done ($(VENV))"

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m deck.demo

# Two test processes: about half of a sequential run's time goes to waiting (process starts,
# servers, storage), so two keep a 2-core machine busy (40 -> 22 min here). A test module stays in
# one process (--dist loadfile): its rank pools and servers start once. TEST_WORKERS=0 runs
# sequentially (one process, as pytest alone does).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The generative differential test with a random seed and many more examples than CI's fixed
# budget; a failure prints the setup as a line to paste into the test's PINNED list.
# FUZZ_SEED=N repeats a run.
# --timeout=0 here and below: the suite's per-test limit (900 s) would end a long run, whose
# examples are one test; each example keeps the rank pool's own limit.
FUZZ_EXAMPLES ?= 500
ifndef FUZZ_SEED
FUZZ_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
fuzz: $(STAMP)
	@echo "make fuzz: $(FUZZ_EXAMPLES) examples, seed $(FUZZ_SEED) (repeat: make fuzz FUZZ_SEED=$(FUZZ_SEED))"
	DECK_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) DECK_FUZZ_RANDOM=1 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=0 \
		tests/trainer/test_differential.py -k drawn --hypothesis-show-statistics \
		--hypothesis-seed=$(FUZZ_SEED)

# The operations state machine (trainer, merger, GC, verify, follower, kills, storage faults) with
# a random seed and many more examples than CI's; FUZZ_SEED=N repeats a run.
OPS_EXAMPLES ?= 1000
fuzz-ops: $(STAMP)
	@echo "make fuzz-ops: $(OPS_EXAMPLES) examples, seed $(FUZZ_SEED) (repeat: make fuzz-ops FUZZ_SEED=$(FUZZ_SEED))"
	DECK_OPS_EXAMPLES=$(OPS_EXAMPLES) DECK_FUZZ_RANDOM=1 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=0 \
		tests/ops/test_operations_machine.py --hypothesis-seed=$(FUZZ_SEED)

# GC's plans against their references on generated lineages: the grace period replayed against
# every moment planned again, and the plan of the newest steps against the plan of every record
# (tests/ops/test_grace_incremental.py, test_gc_window.py). GC_EXAMPLES per test.
GC_EXAMPLES ?= 5000
fuzz-gc: $(STAMP)
	@echo "make fuzz-gc: $(GC_EXAMPLES) examples, seed $(FUZZ_SEED) (repeat: make fuzz-gc FUZZ_SEED=$(FUZZ_SEED))"
	DECK_GRACE_EXAMPLES=$(GC_EXAMPLES) DECK_FUZZ_RANDOM=1 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=0 \
		tests/ops/test_grace_incremental.py tests/ops/test_gc_window.py --hypothesis-seed=$(FUZZ_SEED)

# The Kafka loader's state machine (tests/ops/test_kafka_machine.py) with random sequences;
# a failure prints the shrunk sequence of rules. KAFKA_EXAMPLES / KAFKA_STEPS size the run.
KAFKA_EXAMPLES ?= 50
KAFKA_STEPS ?= 30
fuzz-kafka: $(STAMP)
	@echo "make fuzz-kafka: $(KAFKA_EXAMPLES) examples of up to $(KAFKA_STEPS) rules, seed $(FUZZ_SEED)"
	DECK_KAFKA_EXAMPLES=$(KAFKA_EXAMPLES) DECK_KAFKA_STEPS=$(KAFKA_STEPS) DECK_KAFKA_RANDOM=1 \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=0 tests/ops/test_kafka_machine.py \
		--hypothesis-seed=$(FUZZ_SEED)

# The long-history merge test at the size the merger must handle (10,000 deltas, ~10 min of CPU;
# CI runs it at 1,500 under a tight recursion limit).
long: $(STAMP)
	DECK_LONG_DELTAS=10000 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=0 \
		tests/merge/test_long_history.py -k catches_up_on_a_long_history

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

ruff: $(STAMP)
	$(BIN)/ruff check deck kernels adapters tests benchmarks
	$(BIN)/ruff format --check deck kernels adapters tests benchmarks

mypy: $(STAMP)
	$(BIN)/mypy deck kernels adapters

lint: ruff mypy

clean:
	rm -rf $(VENV) build dist *.egg-info kernels/*.so
