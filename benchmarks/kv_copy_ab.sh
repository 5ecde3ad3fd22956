#!/usr/bin/env bash
# The draft's KV copy, before and after, in one run: `specdec bench` on the same bundle and prompts with the code of
# BEFORE (default 17a940d, the last commit without the copy) and of this checkout, interleaved new / old / new.
#   bash benchmarks/kv_copy_ab.sh [BUNDLE]        → benchmarks/results/issue11/kv-copy/ (summary-{new,old,new2}.md)
# Greedy, model drafter at γ = 4, one prompt per class, 96 new tokens; read the ratios (the machine is shared).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle=$(cd "$(dirname "${1:-$root/bundles/smollm2-q41}")" && pwd)/$(basename "${1:-$root/bundles/smollm2-q41}")
out=${OUT:-$root/benchmarks/results/issue11/kv-copy}
python=${PYTHON:-$root/.venv/bin/python}
before=${BEFORE:-17a940d}
old=$(mktemp -d)/specdec-before
git -C "$root" worktree add -q --detach "$old" "$before"
trap 'git -C "$root" worktree remove --force "$old"' EXIT
mkdir -p "$out"
for run in new old new2; do
  code=$root; [ "$run" = old ] && code=$old
  echo "[kv_copy_ab $(date +%T)] $run: specdec from $code" >&2
  (cd "$out" && PYTHONPATH=$code "$python" -m specdec.cli bench "$bundle" --out "$out/bench-$run" --prompts "$root/benchmarks/prompts" --per-class 1 \
    --new-tokens 96 --repeats 1 --drafters model --gammas 4 --no-progress --no-plots > /dev/null)
  cp "$out/bench-$run/summary.md" "$out/summary-$run.md"
  cp "$out/bench-$run/requests.csv" "$out/requests-$run.csv"
  rm -rf "$out/bench-$run"
done
"$python" - "$out" <<'PY'
import csv, sys
out = sys.argv[1]
print("| run | mode | TPOT ms | TTFT ms | end-to-end ms/token | acceptance |\n|---|---|---|---|---|---|")
for run in ("new", "old", "new2"):
    sums = {}
    for r in csv.DictReader(open(f"{out}/requests-{run}.csv")):
        s = sums.setdefault(r["mode"], [0.0, 0, 0.0, 0, 0.0, 0.0])
        n = int(float(r["new_tokens"]))
        s[0] += float(r["e2e_s"]) - float(r["ttft_s"]); s[1] += n - 1; s[2] += float(r["ttft_s"]); s[3] += 1
        s[4] += float(r["proposed"] or 0); s[5] += float(r["accepted"] or 0)
    for mode, (tp, tokens, ttft, count, proposed, accepted) in sums.items():
        acc = f"{accepted / proposed:.3f}" if proposed else "–"
        print(f"| {run} | {mode} | {1000 * tp / tokens:.1f} | {1000 * ttft / count:.0f} | "
              f"{1000 * (tp + ttft) / (tokens + count):.1f} | {acc} |")
PY
