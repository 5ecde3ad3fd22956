"""Per-mode summary: percentiles, same-run speedup over target-only, the docs/design.md prediction, agreement."""
from __future__ import annotations

from specdec.bench.config import BASELINE, SYSTEM, Status
from specdec.bench.table import PERCENTILES, polars
from specdec.runtime.adaptive_gamma import expected_speedup


def _percentiles(pl, column: str, name: str) -> list:
    # seconds -> milliseconds
    return [(pl.col(column).quantile(q / 100, "linear") * 1e3).alias(f"{name}_p{q}_ms") for q in PERCENTILES]


def _aggregations(pl) -> list:
    ok = pl.col("status") == Status.OK
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
        pl.when(drafted).then(pl.col("draft_s").sum() / pl.col("proposed").sum()).alias("draft_per_token_s"),
        pl.when(pl.col("verify_passes").sum() > 0).then(
            pl.col("verify_s").sum() / pl.col("verify_passes").sum()).alias("verify_per_pass_s"),
        (pl.col("draft_s").mean() * 1e3).alias("draft_ms"), (pl.col("verify_s").mean() * 1e3).alias("verify_ms"),
        (pl.col("host_s").mean() * 1e3).alias("host_ms"),
        pl.col("identical").mean().alias("identical"), pl.col("token_agreement").mean().alias("token_agreement"),
    ]


def predicted(alpha, drafted: float, share: float, draft_s, verify_s, plain_s, mode: str):
    """docs/design.md from measured α, c and r, over the rounds as they ran: a share f of rounds drafted g tokens on
    average (tokens (1 − α^(g+1))/(1 − α)), the others were plain steps (1 token). Costs in seconds, all measured in
    the same run: a drafted round costs g·draft_s (per drafted token) plus its verify pass V, a plain round one
    target step P (the system's target-only seconds per pass); V comes from the mode's mean pass time
    verify_s = f·V + (1 − f)·P. So r = V / P and c = draft_s / P enter as measured; f = 1, g = γ, r = 1 is the
    paper's formula. 1 for target-only; null where a quantity is unknown."""
    if mode == BASELINE or share == 0:
        return 1.0  # no round drafted: plain decoding
    known = [v for v in (alpha, drafted, share, draft_s, verify_s, plain_s) if v is not None and v == v]
    if len(known) < 6 or share <= 0 or plain_s <= 0:
        return None
    tokens = expected_speedup(min(alpha, 1.0), drafted, 0.0)  # c = 0: tokens per drafting round
    verify = verify_ratio(verify_s, share, plain_s) * plain_s  # V
    cost = share * (drafted * draft_s + verify) + (1.0 - share) * plain_s
    return (share * tokens + 1.0 - share) * plain_s / cost


def verify_ratio(verify_s, share, plain_s):
    """r = V / P (see predicted), or None."""
    if any(v is None or v != v for v in (verify_s, share, plain_s)) or share <= 0 or plain_s <= 0:
        return None
    return (verify_s - (1.0 - share) * plain_s) / share / plain_s


def summary_from_requests(frame):
    """requests DataFrame -> one row per (system, mode), in first-seen order, with speedups."""
    pl = polars()
    frame = frame.with_row_index("order")
    summary = frame.group_by(["system", "mode"]).agg([pl.col("order").min(), *_aggregations(pl)]).sort("order")
    base = (summary.filter(pl.col("mode") == BASELINE)
            .select("system", pl.col("tpot_mean_ms").alias("base_tpot"), pl.col("e2e_mean_s").alias("base_e2e"),
                    pl.col("verify_per_pass_s").alias("plain_s")))
    ours = base.filter(pl.col("system") == SYSTEM)["base_tpot"]
    ours_tpot = float(ours[0]) if len(ours) else None
    summary = summary.join(base, on="system", how="left").with_columns(
        (pl.col("base_tpot") / pl.col("tpot_mean_ms")).alias("speedup"),
        (pl.col("base_e2e") / pl.col("e2e_mean_s")).alias("e2e_speedup"),
        (pl.lit(ours_tpot) / pl.col("tpot_mean_ms")).alias("vs_specdec_plain"),
    )
    columns = ("alpha", "drafted_per_round", "drafted_share", "draft_per_token_s", "verify_per_pass_s", "plain_s",
               "mode")
    rows = list(summary.select(*columns).iter_rows())
    summary = summary.with_columns(
        pl.Series("predicted_speedup", [predicted(*row) for row in rows], dtype=pl.Float64),
        pl.Series("verify_ratio", [None if row[-1] == BASELINE else verify_ratio(row[4], row[2], row[5])
                                   for row in rows], dtype=pl.Float64))
    return summary.sort("order").drop("order", "base_tpot", "base_e2e", "plain_s", "draft_per_token_s",
                                      "verify_per_pass_s")


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
