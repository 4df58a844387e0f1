# `make demo` and `make test` each create .venv if missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	FLWR_TELEMETRY_ENABLED=0 $(VENV)/bin/sovfl simulate configs/demo.yaml

test: $(STAMP)
	FLWR_TELEMETRY_ENABLED=0 $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
