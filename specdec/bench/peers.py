"""Peer results: JSONL records written by benchmarks/peers/*.py in their own virtual environments.

A record has the columns of specdec.bench.table.COLUMNS that the peer can measure; the rest are left empty.
`status` is a specdec.bench.config.Status: ok, or unsupported / failed with the reason in `note` (one record per such
mode, no timings).
"""
from __future__ import annotations

import json
from pathlib import Path

from specdec.bench.prompts import read_jsonl
from specdec.errors import ConfigError

REQUIRED = ("system", "mode", "status")


def peer_record_from_json(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})", "peer result files hold one JSON object per line") from exc
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ConfigError(f"{where}: the record lacks {', '.join(missing)}",
                          "rerun the peer's script (benchmarks/peers/*_peer.py) in its venv")
    return record


def read_peer_results(folder: Path) -> list:
    """Every record of every *.jsonl file in `folder`."""
    files = sorted(Path(folder).glob("*.jsonl"))
    if not files:
        raise ConfigError(f"no peer results (*.jsonl) in {folder}",
                          "run a peer's script first (benchmarks/peers/*_peer.py --out DIR/NAME.jsonl, in its venv)")
    return read_jsonl(files, peer_record_from_json)
