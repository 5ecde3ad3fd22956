#!/usr/bin/env bash
# OpenVINO GenAI as a peer, under benchmarks/.peers/ (git-ignored):
#   openvino/   openvino-genai (with openvino and openvino-tokenizers), optimum-intel and nncf for the export, torch
#               2.13.0 (the CPU wheel); optimum-intel goes in without its dependencies, which name torchvision (an
#               unpinned torchvision may pull a CUDA torch; the text-generation export does not use it)
#   hf/ and models/hf-fp32   the checkpoint every peer shares: the default GGUF dequantized (prepare_hf.py; as setup.sh)
#   models/openvino-int4     optimum-cli export openvino --task text-generation-with-past, NNCF int4 asymmetric,
#                            groups of 32, ratio 1.0 (every ratio-defining layer in 4 bits; embeddings and the head
#                            int8 as NNCF's default keeps them); also the `draft` mode's default draft
#   models/openvino-int8     the same, int8 weights (per channel, asymmetric)
#   models/openvino-fp16     the same, fp16 weights
# Each export folder gets export.json: the command, the package versions and NNCF's bitwidth table.
# The flags live in openvino_peer.py (EXPORT_FLAGS). Idempotent: a venv whose pins match and an export whose flags
# match are kept. Prints what it installed.
# Usage: benchmarks/peers/setup_openvino.sh [int4] [int8] [fp16]   (default all three, int4 first)
#        env: SPECDEC_PEERS_DIR, PYTHON, OPENVINO_GENAI_VERSION, OPTIMUM_INTEL_VERSION, NNCF_VERSION
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
peers=${SPECDEC_PEERS_DIR:-$root/benchmarks/.peers}
python=${PYTHON:-python3}
genai=${OPENVINO_GENAI_VERSION:-2026.4.1.0}
optimum_intel=${OPTIMUM_INTEL_VERSION:-2.2.0}
nncf=${NNCF_VERSION:-3.4.0}
precisions=("$@")
[ ${#precisions[@]} -gt 0 ] || precisions=(int4 int8 fp16)
venv=$peers/openvino
mkdir -p "$peers/models"
source "$here/common.sh"  # make_venv, hf_venv, hf_checkpoint

hf_venv
hf_checkpoint

echo "[openvino] venv openvino (openvino-genai $genai, optimum-intel $optimum_intel, nncf $nncf)" >&2
# optimum-intel's own requirements, less torchvision (see above)
make_venv "$venv" torch==2.13.0 "openvino-genai==$genai" "nncf==$nncf" "optimum~=2.3.0" "transformers>=4.51,<5.6" \
  "huggingface-hub>=0.23.2,<1.22" "requests>=2.33,<3" setuptools numpy
if [ "$("$venv/bin/pip" show optimum-intel 2>/dev/null | sed -n 's/^Version: //p')" != "$optimum_intel" ]; then
  "$venv/bin/pip" install -q --no-deps "optimum-intel==$optimum_intel"
fi

for precision in "${precisions[@]}"; do
  flags=$("$venv/bin/python" -c "import sys; sys.path.insert(0, sys.argv[1]); import openvino_peer as o; \
print(' '.join(o.EXPORT_FLAGS[sys.argv[2]]))" "$here" "$precision")
  out=$peers/models/openvino-$precision
  stamp="--task text-generation-with-past $flags"
  if [ -f "$out/openvino_model.xml" ] && [ "$(cat "$out/.flags" 2>/dev/null)" = "$stamp" ]; then
    continue
  fi
  echo "[openvino] export $precision: optimum-cli export openvino $stamp" >&2
  rm -rf "$out"
  # shellcheck disable=SC2086  # $flags is a list of words
  "$venv/bin/optimum-cli" export openvino -m "$peers/models/hf-fp32" --task text-generation-with-past $flags "$out" \
    >"$peers/models/openvino-$precision.log" 2>&1 || { tail -20 "$peers/models/openvino-$precision.log" >&2; exit 1; }
  "$venv/bin/python" - "$out" "$peers/models/openvino-$precision.log" "$stamp" <<'EOF'
import json, sys
from importlib import metadata
out, log, stamp = sys.argv[1:]
table = [line.rstrip() for line in open(log, encoding="utf-8", errors="replace") if line.startswith("│")]
models = "benchmarks/.peers/models"
name = out.rstrip("/").split("/")[-1]
json.dump({"command": f"optimum-cli export openvino -m {models}/hf-fp32 {stamp} {models}/{name}",
           "source": "models/hf-fp32 (prepare_hf.py: the default Q4_1 GGUF dequantized to fp32)",
           "versions": {p: metadata.version(p) for p in ("openvino", "optimum-intel", "nncf", "transformers", "torch")},
           "nncf_bitwidth": [" | ".join(cell.strip() for cell in line.strip("│").split("│")) for line in table]},
          open(f"{out}/export.json", "w"), indent=2)
EOF
  echo "$stamp" > "$out/.flags"
done

echo "[openvino] installed in $venv:" >&2
"$venv/bin/pip" list --format=freeze 2>/dev/null | grep -i -E '^(openvino|optimum|nncf|torch|transformers|numpy)' >&2
for precision in "${precisions[@]}"; do
  echo "[openvino] models/openvino-$precision: $(du -sh "$peers/models/openvino-$precision" | cut -f1)" >&2
done
