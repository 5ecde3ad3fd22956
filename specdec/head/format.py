"""A draft head's weights in a bundle: `head/head.npz` (numpy's own archive of plain arrays, read without pickle) and
the manifest's `head` record (specdec.manifest.HeadRecord), which says what the file must hold.

Tensors, every float one float32 (H: hidden size, F: the target layers fused, D: head dim, Hq / Hkv: query / key-value
heads, I: MLP width, V': the draft vocabulary):
  fc [H, F·H]            the fused feature: fc @ concat(the target's hidden states at its layers, in record order)
  fc_bias [H]            only where the checkpoint has one (vllm-project/speculators' early heads)
  input_norm [H]         RMSNorm of the next token's embedding (the target's embedding, shared)
  hidden_norm [H]        RMSNorm of the fused feature
  q [Hq·D, 2H], k, v [Hkv·D, 2H]   attention over concat(normed embedding, normed feature)
  o [H, Hq·D]            back onto the residual (the feature)
  post_norm [H], gate, up [I, H], down [H, I]   the SiLU-gated MLP
  norm [H]               before the LM head
  lm_head [V', H]        scores the draft vocabulary only
  draft_ids [V'] int64   the target token id of each draft row (EAGLE-3's d2t: draft_ids = arange(V') + d2t)
  inv_freq [D / 2]       the rotary frequencies (positions as the target's: position p turns by p · inv_freq)
"""
from __future__ import annotations

import dataclasses
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import ManifestError
from specdec.manifest import (MANIFEST_NAME, HeadRecord, ModelDims, json_from_manifest, read_manifest, sha256_file,
                              validate_manifest)
from specdec.publish import write_atomic

FORMAT_VERSION = 1
HEAD_PATH = "head/head.npz"
REATTACH = "attach a head made for this target again (specdec calibrate head BUNDLE --from CHECKPOINT)"
F32, I64 = np.dtype("<f4"), np.dtype("<i8")


@dataclass
class HeadWeights:
    fc: np.ndarray  # [H, F·H]
    input_norm: np.ndarray  # [H]
    hidden_norm: np.ndarray  # [H]
    q: np.ndarray  # [Hq·D, 2H]
    k: np.ndarray  # [Hkv·D, 2H]
    v: np.ndarray  # [Hkv·D, 2H]
    o: np.ndarray  # [H, Hq·D]
    post_norm: np.ndarray  # [H]
    gate: np.ndarray  # [I, H]
    up: np.ndarray  # [I, H]
    down: np.ndarray  # [H, I]
    norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [V', H]
    draft_ids: np.ndarray  # [V'] int64: target id of each draft row
    inv_freq: np.ndarray  # [D / 2]
    fc_bias: np.ndarray | None = None  # [H], or None

    def arrays(self) -> dict:
        """name -> array, without the absent optional ones."""
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}


def expected_shapes(record: HeadRecord) -> dict:
    """name -> (shape, dtype) of every tensor the record's head holds (fc_bias apart: optional)."""
    H, D, I = record.hidden_size, record.head_dim, record.intermediate_size  # noqa: E741
    q_rows, kv_rows, V = record.num_heads * D, record.num_kv_heads * D, record.draft_vocab_size
    vector = ((H,), F32)
    return {"fc": ((H, len(record.feature_layers) * H), F32), "input_norm": vector, "hidden_norm": vector,
            "q": ((q_rows, 2 * H), F32), "k": ((kv_rows, 2 * H), F32), "v": ((kv_rows, 2 * H), F32),
            "o": ((H, q_rows), F32), "post_norm": vector, "gate": ((I, H), F32), "up": ((I, H), F32),
            "down": ((H, I), F32), "norm": vector, "lm_head": ((V, H), F32), "draft_ids": ((V,), I64),
            "inv_freq": ((D // 2,), F32)}


def record_for(weights: HeadWeights, feature_layers, vocab_size: int, epsilon: float,
               norm_before_residual: bool = False, source: str = "") -> HeadRecord:
    """The record of `weights` (its dims read from the shapes), before its file is written (path and files empty)."""
    H, D = weights.fc.shape[0], 2 * len(weights.inv_freq)
    return HeadRecord(format=FORMAT_VERSION, path=HEAD_PATH, files={}, hidden_size=H, num_heads=len(weights.q) // D,
                      num_kv_heads=len(weights.k) // D, head_dim=D, intermediate_size=len(weights.gate),
                      vocab_size=int(vocab_size), draft_vocab_size=len(weights.lm_head),
                      feature_layers=[int(layer) for layer in feature_layers], epsilon=float(epsilon),
                      norm_before_residual=bool(norm_before_residual), source=source)


def check_weights(weights: dict, record: HeadRecord, where: str) -> None:
    """ManifestError naming the first tensor of `weights` (name -> array) that is missing, extra, of another shape or
    dtype than `record` says, not finite, or (draft_ids) not distinct ids of the target's vocabulary."""
    if record.format != FORMAT_VERSION:
        raise ManifestError(f"the head's format is {record.format}; this specdec reads format {FORMAT_VERSION}",
                            REATTACH)
    wanted = expected_shapes(record)
    if weights.get("fc_bias") is not None:
        wanted["fc_bias"] = ((record.hidden_size,), F32)
    extra = sorted(set(weights) - set(wanted))
    if extra:
        raise ManifestError(f"{where} holds tensor {extra[0]!r}, which a head of format {FORMAT_VERSION} has not",
                            REATTACH)
    for name, (shape, dtype) in wanted.items():
        array = weights.get(name)
        if array is None or array.shape != shape or array.dtype != dtype:
            seen = "missing" if array is None else f"{array.dtype} {list(array.shape)}"
            raise ManifestError(f"the head's tensor {name} in {where} is {seen}; its record needs {dtype} "
                                f"{list(shape)}", REATTACH)
        if dtype == F32 and not np.isfinite(array).all():
            raise ManifestError(f"the head's tensor {name} in {where} holds NaN or inf", REATTACH)
    ids = weights["draft_ids"]
    if ids.size and (ids.min() < 0 or ids.max() >= record.vocab_size or len(np.unique(ids)) != len(ids)):
        raise ManifestError(f"the head's draft_ids in {where} are not distinct token ids of 0..{record.vocab_size - 1}",
                            REATTACH)


def check_fit(record: HeadRecord, target: ModelDims) -> None:
    """ManifestError naming what differs where the head cannot run beside a target of `target`'s dims."""
    layers = list(record.feature_layers)
    problems = [
        (record.hidden_size != target.hidden_size,
         f"hidden size {record.hidden_size}; the target's is {target.hidden_size}"),
        (record.vocab_size != target.vocab_size,
         f"vocabulary of {record.vocab_size} tokens; the target's has {target.vocab_size}"),
        (not layers or any(not 0 <= layer < target.num_layers for layer in layers) or len(set(layers)) != len(layers),
         f"feature layers {layers}; the target has layers 0..{target.num_layers - 1}, each read once"),
        (record.draft_vocab_size < 1 or record.draft_vocab_size > record.vocab_size,
         f"draft vocabulary of {record.draft_vocab_size} tokens, outside 1..{record.vocab_size}"),
        (record.head_dim < 2 or record.head_dim % 2 or record.num_kv_heads < 1
         or record.num_heads % record.num_kv_heads,
         f"{record.num_heads} query heads, {record.num_kv_heads} key-value heads of {record.head_dim} (query heads "
         "must be a multiple of key-value heads, the head dim even)"),
    ]
    for wrong, what in problems:
        if wrong:
            raise ManifestError(f"the bundle's draft head does not fit its target: the head has {what}", REATTACH)


def read_head(root: Path, record: HeadRecord) -> HeadWeights:
    """The head's weights from the bundle at `root`, every tensor checked against `record` (check_weights)."""
    path = Path(root) / record.path
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: np.ascontiguousarray(archive[name]) for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ManifestError(f"the head's weights {record.path} cannot be read: {exc}", REATTACH) from None
    check_weights(arrays, record, record.path)
    return HeadWeights(**arrays)


def write_head(bundle: Path, weights: HeadWeights, record: HeadRecord) -> HeadRecord:
    """Write `weights` to the bundle's HEAD_PATH (atomically) after checking them against `record`; -> the record
    with its file's sha256."""
    arrays = {name: np.ascontiguousarray(value) for name, value in weights.arrays().items()}
    check_weights(arrays, record, "the weights to write")
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path = Path(bundle) / HEAD_PATH
    write_atomic(path, buffer.getvalue())
    return dataclasses.replace(record, path=HEAD_PATH, files={HEAD_PATH: sha256_file(path)})


def attach_head(bundle: Path, weights: HeadWeights, record: HeadRecord) -> HeadRecord:
    """Give the bundle at `bundle` this head (replacing any it had): its weights file, then its manifest record,
    checked against the target first. -> the record written."""
    manifest = read_manifest(bundle)
    check_fit(record, manifest.target.dims)
    written = write_head(bundle, weights, record)
    updated = dataclasses.replace(manifest, head=written)
    validate_manifest(updated)
    write_atomic(Path(bundle) / MANIFEST_NAME, json_from_manifest(updated))
    return written
