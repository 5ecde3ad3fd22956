#!/usr/bin/env bash
# Issue 11's acceptance run: the default bundle (make demo's: int4-q41 self-draft) against onnxruntime-genai and
# transformers on the full prompt suite, then the per-step tables. Results under benchmarks/results/suite/.
#   BUNDLE=bundles/smollm2-q41 bash benchmarks/suite.sh      (after `make bundle` and benchmarks/peers/setup.sh)
# Timings are ratios within one run; the machine must be otherwise idle (each step says when it ran). Ratios
# between systems: lockstep/ (each system's turn on a prompt before the next prompt), not the sequential tables.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
bundle=${BUNDLE:-$root/bundles/smollm2-q41}
out=${OUT:-$root/benchmarks/results/suite}
python=${PYTHON:-python}
per_class=${PER_CLASS:-0}        # 0: all 50 prompts
tokens=${NEW_TOKENS:-128}
gammas=${GAMMAS:-4,6}
peer_gamma=${PEER_GAMMA:-4}
backends=${BACKENDS:-onnxruntime,native}  # specdec's systems in the lock-step run
mkdir -p "$out"
log() { echo "[suite $(date +%T)] $*" >&2; }

log "specdec bench: target-only, model and auto (γ sweep $gammas), prompt_lookup"
"$python" -m specdec.cli bench "$bundle" --out "$out" --per-class "$per_class" --new-tokens "$tokens" --repeats 1 \
  --gammas "$gammas" --no-progress
log "peer: onnxruntime-genai"
"$python" "$here/run_peers.py" --bundle "$bundle" --out "$out/peers" --only ortgenai --per-class "$per_class" \
  --new-tokens "$tokens" --repeats 1 --gamma "$peer_gamma" --timeout 7200
log "peer: transformers (HF_PER_CLASS prompts per class: it is the slowest system)"
"$python" "$here/run_peers.py" --bundle "$bundle" --merge "$out" --only hf --per-class "${HF_PER_CLASS:-$per_class}" \
  --new-tokens "$tokens" --repeats 1 --gamma "$peer_gamma" --timeout 7200 > "$out/merged.md"
log "lock-step: specdec and onnxruntime-genai request by request (the ratios between systems to trust)"
"$python" "$here/lockstep.py" "$bundle" --out "$out/lockstep" --per-class "$per_class" --new-tokens "$tokens" \
  --peer-gamma "$peer_gamma" --backends "$backends" > /dev/null
log "per-step: decode by cache length against the peer's fp32 and INT4 graphs"
"$python" "$here/decode_vs_ortgenai.py" "$bundle" \
  --sides specdec:target,native:target,ortgenai:fp32,specdec:draft,native:draft,ortgenai:int4 --rounds 3 > "$out/steps.md"
log "memory-bandwidth floor, profiles"
"$python" "$here/membw.py" "$bundle" --out "$out/membw.md"
"$python" "$here/profile_ops.py" "$bundle" > "$out/profile.md"
log "done: $out"
