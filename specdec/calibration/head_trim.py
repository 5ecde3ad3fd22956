"""Which tokens a frequency-trimmed draft LM head keeps.

A draft whose head scores only the N tokens the target is most likely to emit reads a fraction of the head's bytes
(a third of the INT4 self-draft's bytes at full size) and stays exact: the draft proposes from what it scored, and
acceptance compares the target with the q the draft actually proposed (a token it cannot propose has q = 0, and a
greedy draft is simply rejected where the target's choice lies outside its set). The graph keeps the vocabulary
dimension: the trimmed logits are scattered back to [.., V] with a large negative value elsewhere, so the runtime
and the manifest's I/O stay as they are, and the kept ids live in the graph (the GatherElements' index table).

Tokens are ranked by the target's probability mass summed over calibration text (teacher-forced, every position):
the mass follows what the model emits, not only the few tokens the text happens to hold. Every token of the text
and the bundle's special tokens (EOS, BOS, pad) are kept as well.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from specdec.manifest import Manifest, ModelEntry

log = logging.getLogger(__name__)

MAX_TEXT_TOKENS = 256  # tokens per calibration text fed to the target (one prefill each)


def probability_mass(backend, texts: list) -> tuple[np.ndarray, set]:
    """(target probability summed over every position of every text [V], token ids the texts hold)."""
    mass, seen = None, set()
    for ids in texts:
        ids = ids[: min(MAX_TEXT_TOKENS, backend.max_seq_len)]
        if len(ids) < 2:
            continue
        seen.update(ids)
        backend.reset(1)
        logits = backend.forward(np.array([ids], dtype=np.int64), np.zeros(1, np.int64))[0]  # [T, V]
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        mass = probs.sum(axis=0) if mass is None else mass + probs.sum(axis=0)
    return mass, seen


def special_ids(manifest: Manifest) -> set:
    tok = manifest.tokenizer
    return {int(t) for t in [*tok.eos_token_ids, tok.bos_token_id, tok.pad_token_id] if t is not None}


def kept_tokens(bundle: Path, manifest: Manifest, entry: ModelEntry, texts: list, count: int) -> np.ndarray:
    """Sorted token ids [N'] (N' >= count where texts or special tokens add some) of a trimmed head, ranked with
    `entry` (the fp32 model the draft is quantized from) over `texts` (token id lists)."""
    from specdec.runtime.ort_backend import OrtBackend

    backend = OrtBackend(Path(bundle), entry).open()
    try:
        mass, seen = probability_mass(backend, texts)
    finally:
        backend.close()
    vocab = entry.dims.vocab_size
    keep = np.zeros(vocab, dtype=bool)
    keep[np.argsort(-mass, kind="stable")[:count]] = True
    keep[[t for t in seen | special_ids(manifest) if 0 <= t < vocab]] = True
    log.info("trimmed head: %d of %d tokens (top %d by target probability mass over %d texts)", keep.sum(), vocab,
             count, len(texts))
    return np.flatnonzero(keep).astype(np.int64)
