#!/usr/bin/env bash
# Every quantized draft of the default model, side by side (issue 5): builds the bundles under bundles/drafts/
# (about 20 minutes on 2 cores, GPTQ alone about 10), then one quality report against the fp32 target:
# size, ms/step, top-1 agreement and perplexity on held-out text, acceptance and speedup as a draft.
#   bash benchmarks/drafts.sh [results.md]        (after `make bundle`; run on an otherwise idle machine)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=${1:-benchmarks/results/drafts.md}
B=bundles/smollm2  # fp32 target + INT4 RTN draft (specdec-export defaults)
D=bundles/drafts
mkdir -p "$D"
build() {  # build DIR COMMAND...: skip what exists
  [ -f "$1/manifest.json" ] || "${@:2}"
}
for method in int4-hqq int4-gptq int4-q41 int8-qdq; do
  build "$D/$method" "$BIN/specdec" calibrate quantize "$B" --method "$method" --out "$D/$method" --overwrite
done
for k in 16 8; do
  build "$D/layers$k" "$BIN/specdec-export" --draft-layers "$k" --out "$D/layers$k" --overwrite
  build "$D/layers$k-q41" "$BIN/specdec" calibrate quantize "$D/layers$k" --source draft --method int4-q41 \
    --out "$D/layers$k-q41" --overwrite
done
"$BIN/specdec" calibrate report "$B" "$D/int4-hqq" "$D/int4-gptq" "$D/int4-q41" "$D/int8-qdq" \
  "$D/layers16" "$D/layers16-q41" "$D/layers8" "$D/layers8-q41" --reference "$B" \
  --out "$OUT" --csv "${OUT%.md}.csv"
cat "$OUT"
