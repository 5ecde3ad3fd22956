"""Compare draft choices for one target across several `specdec bench` runs (one per bundle: the INT4 self-draft,
layer-truncated drafts at several K, ...). Each row's speedup is over target-only measured in that bundle's own run.

    python benchmarks/default_pair.py benchmarks/results/smollm2 /tmp/bench-sm2 /tmp/bench-sm4 --out table.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HEADER = ("| bundle (draft) | mode | α | mean acc. len | c | TPOT p50 ms | speedup | predicted | identical |\n"
          "|---|---|---|---|---|---|---|---|---|")


def fmt(value, pattern: str) -> str:
    return "–" if value is None or value != value else pattern.format(value)


def rows_of(folder: Path, draft_label: str) -> list:
    import polars as pl

    summary = pl.read_parquet(folder / "summary.parquet").filter(pl.col("system") == "specdec")
    lines = []
    for row in summary.iter_rows(named=True):
        lines.append(f"| {draft_label} | {row['mode']} | {fmt(row['alpha'], '{:.2f}')} | "
                     f"{fmt(row['mean_acceptance_length'], '{:.2f}')} | {fmt(row['cost_ratio'], '{:.3f}')} | "
                     f"{fmt(row['tpot_p50_ms'], '{:.1f}')} | {fmt(row['speedup'], '{:.2f}×')} | "
                     f"{fmt(row['predicted_speedup'], '{:.2f}×')} | {fmt(row['identical'], '{:.0%}')} |")
    return lines


def draft_label(folder: Path) -> str:
    bundle = Path(json.loads((folder / "run.json").read_text())["bundle"])
    manifest = json.loads((bundle / "manifest.json").read_text())
    draft = manifest.get("models", {}).get("draft") or {}
    layers = (draft.get("dims") or {}).get("num_layers")
    return f"{bundle.name} ({draft.get('precision', 'none')}, {layers} layers)" if draft else f"{bundle.name} (none)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="`specdec bench --out` folders")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write (default: stdout)")
    args = parser.parse_args()
    lines = [HEADER]
    for folder in args.runs:
        lines += rows_of(folder, draft_label(folder))
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
