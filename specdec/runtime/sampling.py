"""Logits warping, sampling and the exact acceptance rule of docs/design.md (numpy only).

The same `warp` is applied to the draft's and the target's logits, so acceptance is exact for the warped target
distribution. A proposal with no distribution (prompt lookup) is a point mass: q(d) = 1.
"""
from __future__ import annotations

import numpy as np

from specdec.errors import NumericError
from specdec.runtime.config import GenerationConfig


def softmax(logits: np.ndarray) -> np.ndarray:
    # logits: [..., V] -> probabilities [..., V] in float64
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def warp(logits: np.ndarray, config: GenerationConfig) -> np.ndarray:
    """Temperature, then top-k, then top-p; returns probabilities [..., V] (float64). The maximum is subtracted
    before dividing, so a tiny temperature gives a point mass on the argmax, never an overflow. logits may be a
    device backend's (specdec.cuda.logits.DeviceLogits): they are read to the host here. `config`: a row's effective
    options (RequestLayer.config); where top_k or top_p is unset (None: a config no bundle's defaults filled), it is
    off."""
    logits = np.asarray(logits)
    top_k, top_p = config.top_k or 0, 1.0 if config.top_p is None else config.top_p
    peak = logits.max(axis=-1, keepdims=True)  # NaN where a logit is NaN, inf where one is +inf
    if not np.isfinite(peak).all():  # every backend refuses such logits first (NumericError); never sample them
        raise NumericError(f"logits to sample from hold {float(peak[~np.isfinite(peak)][0])}",
                           "a backend returned logits it did not check: report it with the bundle's manifest")
    shifted = logits.astype(np.float64) - peak
    with np.errstate(over="ignore", divide="ignore"):
        scaled = shifted / config.temperature  # <= 0; -inf where a tiny temperature overflows
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(scaled, vocab - top_k, axis=-1)[..., vocab - top_k, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = softmax(scaled)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass strictly above each token
        keep_sorted = before < top_p  # keeps the smallest prefix whose mass reaches top_p
        keep = np.empty_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    # probs: [V], need not be normalized
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def gumbel_noise(seed: int, row: int, position: int, vocab: int) -> np.ndarray:
    """Gumbel(0, 1) noise [V] of generated position `position` of row `row` of a request seeded `seed`."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(row, position)))
    return rng.gumbel(size=vocab)


def gumbel_choice(probs: np.ndarray, noise: np.ndarray) -> int:
    """argmax(log p + G): a sample of p (the Gumbel-max trick) that is a fixed function of the noise."""
    with np.errstate(divide="ignore"):
        return int(np.argmax(np.log(probs) + noise))


def accept_greedy(drafts: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """drafts: [k]; target_argmax: [k+1] -> (accepted count n, the token emitted after them)."""
    mismatch = np.flatnonzero(drafts != target_argmax[: len(drafts)])
    accepted = int(mismatch[0]) if mismatch.size else len(drafts)
    return accepted, int(target_argmax[accepted])


def accept_sampled(drafts, q, p, uniforms, rng) -> tuple[int, int]:
    """The rule of Leviathan et al.: accept d_i iff r_i < p_i(d_i) / q_i(d_i); at the first rejection emit a
    sample of norm(max(0, p_i - q_i)); if all k are accepted emit a sample of p_{k+1}.

    drafts: [k]; q: [k, V] or None for point masses; p: [k+1, V]; uniforms: [k] in [0, 1).
    """
    for i, token in enumerate(drafts):
        q_token = 1.0 if q is None else q[i, token]
        if uniforms[i] * q_token < p[i, token]:
            continue
        residual = p[i].copy()
        if q is None:
            residual[token] = 0.0
        else:
            residual = np.maximum(residual - q[i], 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: any sample of p is exact
            residual = p[i]
        return i, sample(residual, rng)
    return len(drafts), sample(p[len(drafts)], rng)
