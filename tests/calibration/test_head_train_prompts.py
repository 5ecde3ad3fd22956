"""The training prompts: never the benchmark prompts (benchmarks/prompts/) nor the held-out prompts a trained head is
measured on (benchmarks/head_prompts/); the same for the same seed; chat prompts and raw code and text alike."""
from __future__ import annotations

from pathlib import Path

from specdec.bench.prompts import read_prompts
from specdec.calibration.head_train.prompts import stdlib_harvest, training_prompts
from specdec.cli.demo import PROMPTS as DEMO_PROMPTS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
COUNT = 3000  # more than a default run's share of prompts per 100k answer tokens


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def test_training_prompts_and_the_measured_prompts_are_disjoint():
    measured = [p.text for folder in ("prompts", "head_prompts") for p in read_prompts(BENCHMARKS / folder)]
    measured = {_normal(text) for text in measured + DEMO_PROMPTS}
    training = [_normal(p.text) for p in training_prompts(COUNT, seed=0) + training_prompts(COUNT, seed=1)]
    assert not measured & set(training)
    long_enough = [m for m in measured if len(m) >= 40]  # a measured prompt quoted inside a training one
    assert not [m for m in long_enough if any(m in t for t in training)]
    # the text the prompts quote: none of a measured prompt's sentences is training text
    quoted = {_normal(s) for s in stdlib_harvest().sentences}
    assert not [m for m in measured if any(_normal(s) in quoted for s in m.split(". ") if len(s) >= 40)]


def test_the_seed_fixes_the_prompts_and_they_are_varied():
    first, again, other = training_prompts(400, seed=3), training_prompts(400, seed=3), training_prompts(400, seed=4)
    assert first == again and first != other
    assert len({p.text for p in first}) == 400
    assert {p.chat for p in first} == {True, False}  # chat turns, and raw code or text to continue
    assert any(p.text.startswith("def ") for p in first) and any("\n\n" in p.text for p in first)
