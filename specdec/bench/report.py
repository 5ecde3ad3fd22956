"""Write a run's outputs: requests and summary as parquet + CSV, a markdown summary, PNG plots, run.json."""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

from specdec.bench.config import SYSTEM
from specdec.bench.summary import per_position, summary_from_requests
from specdec.bench.table import csv_frame, frame_from_records

SUMMARY_COLUMNS = [  # (column, header, format)
    ("system", "system", "{}"), ("mode", "mode", "{}"), ("requests", "n", "{}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"), ("tpot_p90_ms", "p90", "{:.1f}"), ("tpot_p99_ms", "p99", "{:.1f}"),
    ("e2e_p50_ms", "E2E p50 ms", "{:.0f}"), ("e2e_p90_ms", "p90", "{:.0f}"), ("e2e_p99_ms", "p99", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"), ("tokens_per_s_p50", "tok/s p50", "{:.1f}"),
    ("alpha", "α", "{:.2f}"), ("mean_acceptance_length", "mean acc. len", "{:.2f}"), ("cost_ratio", "c", "{:.3f}"), ("drafted_share", "f", "{:.2f}"),
    ("drafted_per_round", "g", "{:.2f}"), ("verify_ratio", "r", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}×"), ("predicted_speedup", "predicted", "{:.2f}×"),
    ("vs_specdec_plain", "vs specdec plain", "{:.2f}×"), ("identical", "identical", "{:.0%}"),
    ("token_agreement", "token agr.", "{:.0%}"), ("note", "note", "{}"),
]


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    return fmt.format(value).replace("|", "/")


def markdown_table(summary) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in SUMMARY_COLUMNS) + " |",
             "|" + "---|" * len(SUMMARY_COLUMNS)]
    for row in summary.iter_rows(named=True):
        lines.append("| " + " | ".join(_cell(row.get(c), f) for c, _, f in SUMMARY_COLUMNS) + " |")
    return "\n".join(lines)


def agreement_lines(summary) -> list:
    lines = []
    for row in summary.iter_rows(named=True):
        if row["identical"] is None:
            continue
        same = "identical" if row["identical"] == 1.0 else f"{row['identical']:.0%} identical"
        lines.append(f"- {row['system']}: {row['mode']}: {same} to specdec target-only greedy "
                     f"(token agreement {row['token_agreement']:.1%})")
    return lines


def markdown(summary, positions: dict, info: dict) -> str:
    head = [f"# specdec bench: {Path(info['bundle']).name}", "",
            f"- date: {info['date']}", f"- machine: {info['machine']}", f"- command: `{info.get('command', '')}`",
            f"- models: {info.get('models', '')}",
            f"- {info['prompts']} prompts ({', '.join(info['classes'])}), {info['repeats']} repeats (mode order "
            f"rotated per repeat), {info['warmup']} warm-up request(s) per mode, {info['max_new_tokens']} new tokens, "
            f"temperature {info['temperature']}, seed {info['seed']}",
            *([f"- prompts as: {info['prompt_format']}"] if info.get("prompt_format") else []), "",
            "TPOT = (E2E − TTFT) / (new tokens − 1). speedup = target-only's token-weighted TPOT over the mode's, "
            "same system, same run. predicted = docs/design.md's formula with the verify cost, (1 − α^(γ+1)) / ((1 − α)(γ·d/P + r)): "
            "α the measured acceptance rate, d the draft time per drafted token, P the system's target-only time per "
            "step, r = a drafted round's verify pass / P, all measured in this run; applied to the rounds as they "
            "ran (a share f of verify passes drafted, on average g tokens; the rest were plain steps, 1 token for P): "
            "predicted = (f·(1 − α^(g+1))/(1 − α) + 1 − f)·P / (f·(g·d + r·P) + (1 − f)·P), the paper's formula when "
            "f = 1, g = γ and r = 1. c = d / the mode's mean verify pass. Host time (Python around the engines) is in "
            "the measured TPOT, not in the prediction. d counts the draft model's prompt prefill as draft time, so it "
            "overstates the per-token cost most for short outputs.", ""]
    body = [markdown_table(summary), "", "## Greedy agreement", "", *agreement_lines(summary), "",
            "## Per-position acceptance", ""]
    body += [f"- {s}: {m}: " + " ".join(f"{v:.2f}" for v in values) for (s, m), values in positions.items()]
    return "\n".join(head + body) + "\n"


def write_outputs(records: list, out: str | Path, info: dict, plots: bool = True) -> dict:
    """Tables, markdown and plots into `out`; returns {kind: path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    requests = frame_from_records(records)
    summary = summary_from_requests(requests)
    info = dict(info, machine=info.get("machine") or machine(),
                date=info.get("date") or datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    paths = dict(requests_parquet=out / "requests.parquet", requests_csv=out / "requests.csv",
                 summary_parquet=out / "summary.parquet", summary_csv=out / "summary.csv",
                 markdown=out / "summary.md", run=out / "run.json")
    requests.write_parquet(paths["requests_parquet"])
    csv_frame(requests).write_csv(paths["requests_csv"])
    summary.write_parquet(paths["summary_parquet"])
    summary.write_csv(paths["summary_csv"])
    paths["markdown"].write_text(markdown(summary, per_position(requests), info), encoding="utf-8")
    paths["run"].write_text(json.dumps(info, indent=2), encoding="utf-8")
    if plots:
        from specdec.bench.plots import plot_latency, plot_speedup_vs_gamma

        paths["latency_png"] = plot_latency(requests, out / "latency.png")
        paths["speedup_png"] = plot_speedup_vs_gamma(summary, out / "speedup_vs_gamma.png")
    return paths


def merge_peer_results(bench_out: str | Path, peers: str | Path, plots: bool = True) -> dict:
    """Rewrite a finished run's outputs with peer results (*.jsonl in `peers`) merged into its table; specdec's
    own rows, date and machine are kept, earlier peer rows are replaced."""
    from specdec.bench.peers import read_peer_results
    from specdec.bench.table import polars

    out = Path(bench_out)
    ours = polars().read_parquet(out / "requests.parquet").filter(polars().col("system") == SYSTEM)
    records = [{k: v for k, v in r.items() if k not in ("identical", "token_agreement")} for r in ours.to_dicts()]
    info = json.loads((out / "run.json").read_text(encoding="utf-8"))
    info["peers"] = str(peers)
    return write_outputs(records + read_peer_results(Path(peers)), out, info, plots)
