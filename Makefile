# `make demo`, `make test` and `make soak` each create .venv if missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-hf test soak docs install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	FLWR_TELEMETRY_ENABLED=0 $(VENV)/bin/sovfl simulate configs/demo.yaml

# The Hugging Face LoRA federation (configs/hf-lora.yaml) on a tiny model built locally, then exported.
demo-hf: $(STAMP)
	FLWR_TELEMETRY_ENABLED=0 $(PY) examples/hf_lora_demo.py

# Tests run in TEST_WORKERS processes (pytest-xdist), a test file per worker at a time: the
# end-to-end federations mostly wait on Flower's polling, so three share two cores well.
# TEST_WORKERS=0 runs them one after another in this process.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -c 'from federation.ops.bytecode import ensure_compiled; ensure_compiled()'  # for processes tests start themselves
	FLWR_TELEMETRY_ENABLED=0 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The documentation site into site/ (open site/index.html): the reference pages regenerated from the
# code first (docs/gen_reference.py), then a strict build (a warning, e.g. a broken link, fails it).
docs: $(STAMP)
	$(PY) docs/gen_reference.py
	$(VENV)/bin/mkdocs build --strict --site-dir site

# Long runs. Fuzzing: 100,000 generated inputs per decoder of another party's bytes
# (tests/fuzzing/README.md); FUZZ_ARGS passes options, e.g. FUZZ_ARGS="--inputs 1000 envelope-blob".
# Fault injection: 20 seeded SIGKILLs (coordinator, SuperNodes, trainer ranks) over a 15-round 3-site SecAgg+ digits run
# (tests/fault_soak.py); FAULT_ARGS passes options, e.g. FAULT_ARGS="--kills 3 --rounds 5 --seed 1".
soak: $(STAMP)
	FLWR_TELEMETRY_ENABLED=0 $(PY) tests/fuzz_soak.py $(FUZZ_ARGS)
	FLWR_TELEMETRY_ENABLED=0 $(PY) tests/fault_soak.py $(FAULT_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache site
