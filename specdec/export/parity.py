"""ONNX-vs-PyTorch parity, run on every export: prefill, 3 decode steps, a verify of γ_max+1, a rollback, 2 steps.

The reference is the Hugging Face model itself, run without a cache over each row's whole committed sequence,
so the check covers positions, masking, the KV write-back and rollback together.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import ExportError
from specdec.manifest import ModelDims, ParityStep

RELATIVE_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}
NUMPY_KV = {"fp32": np.float32, "fp16": np.float16, "bf16": None}


@dataclass
class PlainRunner:
    """Drives the plain graph: static KV buffers written the way every backend writes them."""

    session: object
    keys: np.ndarray  # [L, B, Hkv, S, D]
    values: np.ndarray

    def step(self, ids: np.ndarray, cache_len: np.ndarray) -> np.ndarray:
        # ids: [B, T] -> logits [B, T, V]; new_*: [L, B, Hkv, T, D] written at [cache_len[b], +T)
        feeds = {"input_ids": ids, "cache_len": cache_len, "past_keys": self.keys, "past_values": self.values}
        logits, new_keys, new_values = self.session.run(None, feeds)
        steps = ids.shape[1]
        for row, start in enumerate(cache_len):
            self.keys[:, row, :, start : start + steps] = new_keys[:, row]
            self.values[:, row, :, start : start + steps] = new_values[:, row]
        return logits


@dataclass
class GqaRunner:
    """Drives the gqa graph row by row (B = 1), its present KV becoming the next past."""

    session: object
    caches: list  # per row: list of 2L arrays [1, Hkv, S, D]

    def step(self, ids: np.ndarray, cache_len: np.ndarray) -> np.ndarray:
        names = [i.name for i in self.session.get_inputs()][3:]
        out = []
        for row, cache in enumerate(self.caches):
            feeds = {"input_ids": ids[row : row + 1], "cache_len": cache_len[row : row + 1],
                     "logit_positions": np.arange(ids.shape[1], dtype=np.int64), **dict(zip(names, cache))}
            logits, *presents = self.session.run(None, feeds)
            self.caches[row] = presents
            out.append(logits[0])
        return np.stack(out)


def runner_for(session, dims: ModelDims, max_seq_len: int, dtype: str, lowering: str):
    kv = NUMPY_KV[dtype]
    if lowering == "gqa":
        shape = (1, dims.num_kv_heads, max_seq_len, dims.head_dim)
        return GqaRunner(session, [[np.zeros(shape, kv) for _ in range(2 * dims.num_layers)] for _ in range(2)])
    shape = (dims.num_layers, 2, dims.num_kv_heads, max_seq_len, dims.head_dim)
    return PlainRunner(session, np.zeros(shape, kv), np.zeros(shape, kv))


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
    """Run the plan through a runner (see runner_for) and `model`; returns (steps, max |logit|)."""
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
        logits = runner.step(new_ids, cache_len)
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
    failed = [s for s in steps if s.enforced and s.max_abs_diff > s.tolerance]
    if failed:
        worst = max(failed, key=lambda s: s.max_abs_diff)
        raise ExportError(
            f"{role} ONNX logits differ from PyTorch by {worst.max_abs_diff:.3g} at step {worst.name!r} "
            f"(tolerance {worst.tolerance:.3g})",
            "the graph is wrong for this architecture; run with -v and report it with the model's config",
        )
