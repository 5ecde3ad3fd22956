"""`specdec bench --quick` on a tiny bundle: the outputs exist and are well-formed (never timings)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pl = pytest.importorskip("polars")
pytest.importorskip("matplotlib")

from specdec.bench.config import BASELINE  # noqa: E402
from specdec.bench.table import COLUMNS  # noqa: E402
from specdec.cli.bench import add_bench_parser  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
CLASSES = {"chat", "story", "code", "rewrite", "summarize"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(argv: list) -> int:
    parser = argparse.ArgumentParser(prog="specdec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


@pytest.fixture(scope="module")
def quick_run(int4_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    assert run_cli(["bench", str(int4_bundle), "--quick", "--out", str(out), "--prompts", str(PROMPTS),
                    "--no-progress", "--gamma-policies", "adaptive,heuristic"]) == 0
    return out


def test_prompt_sets_are_committed_and_large_enough():
    from specdec.bench.prompts import read_prompts

    prompts = read_prompts(PROMPTS)
    assert len(prompts) >= 40
    assert {p.cls for p in prompts} == CLASSES


def test_requests_table(quick_run):
    requests = pl.read_parquet(quick_run / "requests.parquet")
    assert list(requests.columns) == list(COLUMNS)
    modes = requests["mode"].unique().to_list()
    # target-only, model γ=3 (the bundle's), prompt_lookup, auto, the sweep's γ = 1, 2 for model and for auto,
    # adaptive and heuristic γ
    assert len(modes) == 10 and BASELINE in modes
    assert {"model adaptive γ from 3", "model heuristic γ from 3", "auto γ=1", "auto γ=2"} <= set(modes)
    assert requests.height == len(modes) * len(CLASSES)  # one repeat, the shortest prompt of each class
    assert set(requests["cls"].to_list()) == CLASSES
    assert (requests["status"] == "ok").all()
    assert requests["new_tokens"].min() >= 1
    assert requests["identical"].all()  # greedy output is exact across drafters
    csv = pl.read_csv(quick_run / "requests.csv")
    assert csv.height == requests.height and list(csv.columns) == list(COLUMNS)
    assert json.loads(csv["token_ids"][0]) == requests["token_ids"][0].to_list()


def test_summary_outputs(quick_run):
    summary = pl.read_parquet(quick_run / "summary.parquet")
    assert summary.height == 10  # one row per mode
    for column in ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "e2e_p50_ms", "speedup", "predicted_speedup",
                   "alpha", "cost_ratio", "identical", "token_agreement"):
        assert column in summary.columns
    base = summary.filter(pl.col("mode") == BASELINE)
    assert base["speedup"][0] == pytest.approx(1.0) and base["predicted_speedup"][0] == 1.0
    assert pl.read_csv(quick_run / "summary.csv").height == summary.height
    text = (quick_run / "summary.md").read_text(encoding="utf-8")
    assert "| system | mode |" in text and "## Greedy agreement" in text
    assert text.count("\n| specdec |") == summary.height
    assert json.loads((quick_run / "run.json").read_text())["repeats"] == 1


def test_plots_are_png(quick_run):
    for name in ("latency.png", "speedup_vs_gamma.png"):
        data = (quick_run / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_peer_results_merge(int4_bundle, quick_run, tmp_path):
    peers = tmp_path / "peers"
    peers.mkdir()
    ids = pl.read_parquet(quick_run / "requests.parquet").filter(pl.col("mode") == BASELINE)
    lines = [dict(system="peer", mode=BASELINE, status="ok", prompt_id=pid, cls=cls, repeat=0, new_tokens=len(t),
                  e2e_s=1.0, ttft_s=0.1, tpot_s=0.9 / max(1, len(t) - 1), token_ids=t)
             for pid, cls, t in ids.select("prompt_id", "cls", "token_ids").iter_rows()]
    lines.append(dict(system="peer", mode="n-gram", status="unsupported", note="not in this version"))
    (peers / "peer.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "merged"
    assert run_cli(["bench", str(int4_bundle), "--quick", "--out", str(out), "--prompts", str(PROMPTS),
                    "--no-progress", "--no-plots", "--drafters", "prompt_lookup", "--peers", str(peers)]) == 0
    summary = pl.read_parquet(out / "summary.parquet")
    peer = summary.filter(pl.col("system") == "peer")
    assert peer.height == 2 and peer.filter(pl.col("mode") == BASELINE)["identical"][0] == 1.0
    assert "not in this version" in (out / "summary.md").read_text(encoding="utf-8")
