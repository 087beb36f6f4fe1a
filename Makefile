VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast proto bench bench-env bench-aggregation bench-transfer clean

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

## The whole federation on this machine: env servers, aggregator, one client per environment.
run: $(STAMP)
	$(VENV)/bin/fedse run $(ARGS)

## What CI runs.
test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

## Regenerate the committed gRPC code with the pinned grpcio-tools.
proto: $(STAMP)
	$(PY) -m fedse.protogen

bench: bench-env bench-aggregation bench-transfer

bench-env: $(STAMP)
	$(PY) bench/env_throughput.py

bench-aggregation: $(STAMP)
	$(PY) bench/aggregation.py

bench-transfer: $(STAMP)
	$(PY) bench/transfer.py

clean:
	rm -rf $(VENV) results
