"""PNG plots from the tables: latency distributions per mode, and measured vs predicted speedup against γ.
matplotlib's object API (Figure) is used directly: no pyplot, no global backend switch."""
from __future__ import annotations

from pathlib import Path

from specdec.bench.config import SYSTEM, Status
from specdec.errors import missing_dependency
from specdec.runtime.config import DrafterName


def _figure(width: float, height: float, columns: int = 1):
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise missing_dependency("matplotlib", "bench") from exc
    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def plot_latency(requests, path: Path) -> Path:
    """Box plots of time per output token and end-to-end latency per (system, mode)."""
    ok = requests.filter(requests["status"] == Status.OK)
    labels, tpot, e2e = [], [], []
    for (system, mode), group in ok.group_by(["system", "mode"], maintain_order=True):
        labels.append(f"{system}: {mode}")
        tpot.append((group["tpot_s"] * 1e3).to_list())
        e2e.append(group["e2e_s"].to_list())
    figure, (left, right) = _figure(13, 0.45 * len(labels) + 1.5, 2)
    left.boxplot(tpot, vert=False, tick_labels=labels, showfliers=True)
    left.set_xlabel("time per output token (ms)")
    left.invert_yaxis()
    right.boxplot(e2e, vert=False, tick_labels=[""] * len(labels), showfliers=True)
    right.set_xlabel("end-to-end latency (s)")
    right.invert_yaxis()
    figure.suptitle("Latency per request (greedy, same run)")
    figure.savefig(path, dpi=110)
    return path


def plot_speedup_vs_gamma(summary, path: Path) -> Path:
    """specdec's model drafter: measured same-run speedup and the docs/design.md prediction against γ."""
    rows = summary.filter((summary["system"] == SYSTEM) & (summary["drafter"] == DrafterName.MODEL)).sort("gamma")
    figure, (axes,) = _figure(6.5, 4.2)
    gammas = rows["gamma"].to_list()
    axes.plot(gammas, rows["speedup"].to_list(), "o-", label="measured (same run)")
    axes.plot(gammas, rows["predicted_speedup"].to_list(), "s--", label="predicted from measured α, c")
    axes.set_xticks(gammas)
    axes.axhline(1.0, color="grey", linewidth=0.8, label="target-only")
    axes.set_xlabel("γ (drafted tokens per round)")
    axes.set_ylabel("speedup over target-only (time per token)")
    axes.set_title("Model drafter: speedup against γ")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=110)
    return path
