"""Requests and per-mode summaries as polars DataFrames (polars is imported here, lazily for the package)."""
from __future__ import annotations

from specdec.bench.config import BASELINE, SYSTEM, Status
from specdec.errors import missing_dependency
from specdec.runtime.state import common_prefix
# column -> polars dtype name, in table order
COLUMNS = {
    "system": "Utf8", "mode": "Utf8", "drafter": "Utf8", "gamma": "Int64", "note": "Utf8", "status": "Utf8",
    "prompt_id": "Utf8", "cls": "Utf8", "repeat": "Int64", "seed": "Int64", "prompt_tokens": "Int64",
    "new_tokens": "Int64", "finish_reason": "Utf8", "ttft_s": "Float64", "tpot_s": "Float64", "e2e_s": "Float64",
    "tokens_per_s": "Float64", "prefill_s": "Float64", "draft_s": "Float64", "verify_s": "Float64",
    "host_s": "Float64", "proposed": "Int64", "accepted": "Int64", "verify_passes": "Int64", "drafted_rounds": "Int64",
    "acceptance_rate": "Float64", "mean_acceptance_length": "Float64", "per_position": "List(Float64)",
    "token_ids": "List(Int64)", "identical": "Boolean", "token_agreement": "Float64",
}
LIST_COLUMNS = ("per_position", "token_ids")
PERCENTILES = (50, 90, 99)


def polars():
    try:
        import polars as pl
    except ImportError as exc:
        raise missing_dependency("polars", "bench") from exc
    return pl


def schema() -> dict:
    pl = polars()
    scalar = {"Utf8": pl.Utf8, "Int64": pl.Int64, "Float64": pl.Float64, "Boolean": pl.Boolean}
    return {name: pl.List(scalar[kind[5:-1]]) if kind.startswith("List(") else scalar[kind]
            for name, kind in COLUMNS.items()}


def add_agreement(records: list) -> list:
    """Compare every record's tokens with specdec target-only greedy on the same prompt (first repeat):
    `identical`, and `token_agreement` = common prefix length / the longer output's length."""
    base = {}
    for r in records:
        if r["system"] == SYSTEM and r["mode"] == BASELINE and r.get("token_ids") is not None:
            base.setdefault(r["prompt_id"], r["token_ids"])
    out = []
    for r in records:
        ids, ref = r.get("token_ids"), base.get(r.get("prompt_id"))
        row = dict(r)
        if ids is not None and ref is not None and r.get("status") == Status.OK:
            row["identical"] = list(ids) == list(ref)
            row["token_agreement"] = common_prefix(ids, ref) / max(len(ids), len(ref), 1)
        out.append(row)
    return out


def frame_from_records(records: list):
    """records (dicts) -> DataFrame with the COLUMNS schema; missing fields are null."""
    pl = polars()
    rows = [{name: r.get(name) for name in COLUMNS} for r in add_agreement(records)]
    return pl.DataFrame(rows, schema=schema(), orient="row")


def csv_frame(frame):
    """The list columns as JSON text, since CSV holds no nested values."""
    pl = polars()
    return frame.with_columns([
        pl.col(c).map_elements(lambda v: "[" + ",".join(str(x) for x in v) + "]", return_dtype=pl.Utf8)
        for c in LIST_COLUMNS
    ])
