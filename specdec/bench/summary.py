"""Per-mode summary: percentiles, same-run speedup over target-only, the DESIGN §1 prediction, agreement."""
from __future__ import annotations

from specdec.bench.config import BASELINE
from specdec.bench.table import PERCENTILES, polars
from specdec.runtime.drafters import expected_speedup


def _percentiles(pl, column: str, name: str) -> list:
    # seconds -> milliseconds
    return [(pl.col(column).quantile(q / 100, "linear") * 1e3).alias(f"{name}_p{q}_ms") for q in PERCENTILES]


def _aggregations(pl) -> list:
    ok = pl.col("status") == "ok"
    decode = (pl.col("e2e_s") - pl.col("ttft_s")).filter(ok).sum()
    drafted = pl.col("proposed").sum() > 0
    return [
        pl.col("status").first(), pl.col("note").first(), pl.col("drafter").first(), pl.col("gamma").first(),
        ok.sum().alias("requests"), pl.col("new_tokens").filter(ok).sum().alias("tokens"),
        *_percentiles(pl, "e2e_s", "e2e"), *_percentiles(pl, "ttft_s", "ttft"), *_percentiles(pl, "tpot_s", "tpot"),
        (decode / (pl.col("new_tokens").filter(ok) - 1).sum() * 1e3).alias("tpot_mean_ms"),
        pl.col("e2e_s").filter(ok).mean().alias("e2e_mean_s"),
        pl.col("tokens_per_s").median().alias("tokens_per_s_p50"),
        pl.when(drafted).then(pl.col("accepted").sum() / pl.col("proposed").sum()).alias("alpha"),
        pl.when(pl.col("verify_passes").sum() > 0).then(
            pl.col("new_tokens").sum() / pl.col("verify_passes").sum()).alias("mean_acceptance_length"),
        (pl.col("drafted_rounds").sum() / pl.col("verify_passes").sum()).alias("drafted_share"),
        pl.when(drafted).then(pl.col("proposed").sum() / pl.col("drafted_rounds").sum()).alias("drafted_per_round"),
        pl.when(drafted & (pl.col("verify_s").sum() > 0)).then(
            (pl.col("draft_s").sum() / pl.col("proposed").sum())
            / (pl.col("verify_s").sum() / pl.col("verify_passes").sum())).alias("cost_ratio"),
        (pl.col("draft_s").mean() * 1e3).alias("draft_ms"), (pl.col("verify_s").mean() * 1e3).alias("verify_ms"),
        (pl.col("host_s").mean() * 1e3).alias("host_ms"),
        pl.col("identical").mean().alias("identical"), pl.col("token_agreement").mean().alias("token_agreement"),
    ]


def predicted(alpha, drafted: float, cost_ratio, share: float, mode: str):
    """DESIGN §1 from measured α and c, over the rounds as they ran: a share f of rounds drafted g tokens on
    average (tokens (1 − α^(g+1))/(1 − α), cost gc + 1), the others were plain steps (1 token, cost 1).
    f = 1, g = γ is the formula itself. 1 for target-only; null where α or c is unknown."""
    if mode == BASELINE:
        return 1.0
    known = [v for v in (alpha, drafted, cost_ratio, share) if v is not None and v == v]
    if len(known) < 4:
        return None
    tokens = expected_speedup(min(alpha, 1.0), drafted, 0.0)  # c = 0: tokens per drafting round
    return (share * tokens + 1.0 - share) / (share * (drafted * cost_ratio + 1.0) + 1.0 - share)


def summary_from_requests(frame):
    """requests DataFrame -> one row per (system, mode), in first-seen order, with speedups."""
    pl = polars()
    frame = frame.with_row_index("order")
    summary = frame.group_by(["system", "mode"]).agg([pl.col("order").min(), *_aggregations(pl)]).sort("order")
    base = (summary.filter(pl.col("mode") == BASELINE)
            .select("system", pl.col("tpot_mean_ms").alias("base_tpot"), pl.col("e2e_mean_s").alias("base_e2e")))
    ours = base.filter(pl.col("system") == "specdec")["base_tpot"]
    ours_tpot = float(ours[0]) if len(ours) else None
    summary = summary.join(base, on="system", how="left").with_columns(
        (pl.col("base_tpot") / pl.col("tpot_mean_ms")).alias("speedup"),
        (pl.col("base_e2e") / pl.col("e2e_mean_s")).alias("e2e_speedup"),
        (pl.lit(ours_tpot) / pl.col("tpot_mean_ms")).alias("vs_specdec_plain"),
    )
    prediction = [predicted(a, g, c, f, m) for a, g, c, f, m in
                  summary.select("alpha", "drafted_per_round", "cost_ratio", "drafted_share", "mode").iter_rows()]
    summary = summary.with_columns(pl.Series("predicted_speedup", prediction, dtype=pl.Float64))
    return summary.sort("order").drop("order", "base_tpot", "base_e2e")


def per_position(frame) -> dict:
    """(system, mode) -> mean per-position acceptance over requests (lists of unequal length padded)."""
    sums: dict = {}
    for system, mode, values in frame.select("system", "mode", "per_position").iter_rows():
        if not values:
            continue
        total, count = sums.setdefault((system, mode), ([], []))
        for i, v in enumerate(values):
            if i == len(total):
                total.append(0.0)
                count.append(0)
            total[i] += v
            count[i] += 1
    return {key: [t / c for t, c in zip(*pair)] for key, pair in sums.items()}
