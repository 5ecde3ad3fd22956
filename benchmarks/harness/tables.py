"""Markdown tables and CSV files: a table is markdown (for people and the docs); a CSV is written only where a plot
or a generated page reads the numbers."""
from __future__ import annotations

import csv
from pathlib import Path


def markdown(header: list, rows: list) -> str:
    """A markdown table; cells are written as given (format numbers before)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list) -> Path:
    """rows: dicts with the same keys (the first row's order)."""
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, list(rows[0]) if rows else [], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_text(path: Path, text: str) -> Path:
    path = Path(path)
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return path
