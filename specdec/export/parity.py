"""ONNX-vs-PyTorch parity, run on every export: prefill, 3 decode steps, a verify of γ_max+1, a rollback, 2 steps.

The reference is the Hugging Face model itself, run without a cache over each row's whole committed sequence,
so the check covers positions, masking, the KV write-back and rollback together.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from specdec.errors import ExportError
from specdec.lowering import lowering_for
from specdec.manifest import ModelDims, ParityStep, Precision

RELATIVE_TOLERANCE = {Precision.FP32: 1e-4, Precision.FP16: 2e-2, Precision.BF16: 5e-2}


def runner_for(session, dims: ModelDims, max_seq_len: int, kv_dtype: str, lowering: str, batch: int = 2):
    """The lowering's driver (the one every backend uses) over `session`, with `batch` empty KV slots."""
    driver = lowering_for(lowering).driver(session, dims, max_seq_len, kv_dtype)
    driver.reset(batch)
    return driver


def parity_plan(gamma_max: int, prefill: int) -> list[tuple[str, int, list[int]]]:
    """(step name, T, per-row rollback before the step) for a batch of 2 rows."""
    plan = [("prefill", prefill, [0, 0])]
    plan += [(f"decode{i + 1}", 1, [0, 0]) for i in range(3)]
    plan.append(("verify", gamma_max + 1, [0, 0]))
    # rollback: row 0 keeps 1 verified token, row 1 keeps none (ragged acceptance)
    plan.append(("rollback_decode1", 1, [gamma_max, gamma_max + 1]))
    plan.append(("rollback_decode2", 1, [0, 0]))
    return plan


def _reference_logits(model, rows: list[list[int]], steps: int) -> np.ndarray:
    # rows: committed token ids per row (all the same length here) -> logits of the last `steps` positions
    with torch.no_grad():
        ids = torch.tensor(rows, dtype=torch.long)
        return model(input_ids=ids).logits[:, -steps:].float().numpy()


def check_parity(runner, model, dims: ModelDims, max_seq_len: int, gamma_max: int, dtype: str, enforced: bool = True):
    """Run the plan through a driver (see runner_for) and `model`; returns (steps, max |logit|)."""
    rng = np.random.default_rng(0)
    prefill = max(2, min(12, max_seq_len - gamma_max - 8))
    rows: list[list[int]] = [[], []]
    results, peak = [], 0.0
    for name, steps, rollback in parity_plan(gamma_max, prefill):
        for row, back in enumerate(rollback):
            del rows[row][len(rows[row]) - back :]
        cache_len = np.array([len(r) for r in rows], dtype=np.int64)
        if int(cache_len.max()) + steps > max_seq_len:
            break
        new_ids = rng.integers(0, dims.vocab_size, size=(2, steps), dtype=np.int64)
        logits = runner.run(new_ids, cache_len)
        for row in range(2):
            rows[row].extend(int(t) for t in new_ids[row])
        ref = np.concatenate([_reference_logits(model, [r], steps) for r in rows])
        peak = max(peak, float(np.abs(ref).max()))
        diff = float(np.abs(logits.astype(np.float32) - ref).max())
        results.append((name, steps, int(cache_len.min()), diff))
    tolerance = RELATIVE_TOLERANCE[dtype] * peak
    steps_out = [ParityStep(name, 2, t, start, diff, tolerance, enforced) for name, t, start, diff in results]
    return steps_out, peak


def enforce_parity(role: str, steps: list[ParityStep]) -> None:
    """Raise ExportError where an enforced step is over its tolerance, or any step's figures are not finite (NaN
    compares False with every tolerance, so it would otherwise pass)."""
    broken = [s for s in steps if not (math.isfinite(s.max_abs_diff) and math.isfinite(s.tolerance))]
    if broken:
        raise ExportError(
            f"{role} parity at step {broken[0].name!r} is not a number (max |diff| {broken[0].max_abs_diff}, "
            f"tolerance {broken[0].tolerance}): the ONNX graph or PyTorch gives NaN or inf logits",
            "check the model's weights and config for NaN or inf values; run with -v and report it if they are finite",
        )
    failed = [s for s in steps if s.enforced and s.max_abs_diff > s.tolerance]
    if failed:
        worst = max(failed, key=lambda s: s.max_abs_diff)
        raise ExportError(
            f"{role} ONNX logits differ from PyTorch by {worst.max_abs_diff:.3g} at step {worst.name!r} "
            f"(tolerance {worst.tolerance:.3g})",
            "the graph is wrong for this architecture; run with -v and report it with the model's config",
        )
