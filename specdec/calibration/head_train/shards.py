"""The training data on disk: shards of whole sequences (a prompt and the target's answer), each token with the
target's hidden states at the head's layers (float16) and the target's top-k next-token distribution after it.
Sequences stream from memory-mapped shards, so a run holds one batch of features in memory, never the data set.

A shard is a folder `shard-NNNNN/` written whole (staged, then renamed), so a stopped run leaves only whole shards:
  tokens.npy   int32 [N]            every sequence's tokens, one after another
  starts.npy   int64 [S + 1]        sequence s is tokens[starts[s]:starts[s + 1]]
  prompts.npy  int32 [S]            each sequence's prompt length P (its answer starts at P)
  features.npy float16 [N, F, H]    the target's hidden state after each of its F layers, at every token
  top_ids.npy  int32 [N, K]         the target's K likeliest next tokens after each token, likeliest first
  top_probs.npy float16 [N, K]      their probabilities; all 0 where no label is kept (prompt positions before P - 1
                                    and each sequence's last token)
  meta.json    {"prompts": [prompt indices], "generated": answer tokens}
A shard's arrays are ShardArrays; a batch of sequences from them a Batch.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from specdec.publish import write_atomic



@dataclass
class ShardArrays:
    """The arrays of one shard (memory-mapped when read), each in its file NAME.npy."""

    tokens: np.ndarray
    starts: np.ndarray
    prompts: np.ndarray
    features: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray


ARRAYS = tuple(f.name for f in fields(ShardArrays))


@dataclass
class Batch:
    """Sequences padded at the end to the longest (Shards.batch): tokens [B, T], features [B, T, F, H], top_ids
    [B, T, K], top_probs [B, T, K] (0 in padding and wherever no label is kept), prompt_len [B], length [B]."""

    tokens: np.ndarray
    features: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    prompt_len: np.ndarray
    length: np.ndarray


@dataclass
class Sequence:
    """One generated sequence, being built: its arrays grow a token at a time."""

    index: int  # the prompt's index in the run's prompt list
    tokens: list
    prompt_len: int
    features: list  # [F, H] float16 of each fed token
    top_ids: list  # [K] int32
    top_probs: list  # [K] float16


def shard_dir(root: Path, number: int) -> Path:
    return Path(root) / f"shard-{number:05d}"


def write_shard(root: Path, number: int, sequences: list) -> None:
    """Write `sequences` (in order) as shard `number` of `root`, atomically (a staged folder renamed)."""
    final = shard_dir(root, number)
    staged = final.with_name(final.name + ".partial")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    lengths = [len(s.tokens) for s in sequences]
    arrays = ShardArrays(tokens=np.concatenate([np.asarray(s.tokens, np.int32) for s in sequences]),
                         starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                         prompts=np.array([s.prompt_len for s in sequences], np.int32),
                         features=np.concatenate([np.stack(s.features) for s in sequences]).astype(np.float16),
                         top_ids=np.concatenate([np.stack(s.top_ids) for s in sequences]).astype(np.int32),
                         top_probs=np.concatenate([np.stack(s.top_probs) for s in sequences]).astype(np.float16))
    for name in ARRAYS:
        np.save(staged / f"{name}.npy", getattr(arrays, name))
    meta = {"prompts": [s.index for s in sequences], "generated": int(sum(n - s.prompt_len
                                                                          for n, s in zip(lengths, sequences)))}
    write_atomic(staged / "meta.json", json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    staged.rename(final)


def shard_numbers(root: Path) -> list:
    """The numbers of the whole shards under `root`, ascending."""
    if not Path(root).is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in Path(root).glob("shard-[0-9]*")
                  if p.is_dir() and not p.name.endswith(".partial") and (p / "meta.json").is_file())


def shard_meta(root: Path, number: int) -> dict:
    return json.loads((shard_dir(root, number) / "meta.json").read_text(encoding="utf-8"))


class Shards:
    """Every sequence of the shards under `root`, read through memory maps: `len`, and `batch(ids)`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.arrays = []  # ShardArrays of each shard
        self.where = []  # (shard, sequence) of each sequence
        for number in shard_numbers(root):
            folder = shard_dir(root, number)
            arrays = ShardArrays(*(np.load(folder / f"{name}.npy", mmap_mode="r") for name in ARRAYS))
            self.where += [(len(self.arrays), s) for s in range(len(arrays.prompts))]
            self.arrays.append(arrays)

    def __len__(self) -> int:
        return len(self.where)

    def length(self, sequence: int) -> int:
        shard, s = self.where[sequence]
        starts = self.arrays[shard].starts
        return int(starts[s + 1] - starts[s])

    def tokens(self, sequence: int) -> np.ndarray:
        """[n] int32: the tokens of one sequence (a copy)."""
        shard, s = self.where[sequence]
        a = self.arrays[shard]
        return np.array(a.tokens[a.starts[s] : a.starts[s + 1]])

    def batch(self, sequences: list) -> Batch:
        """The sequences, padded at the end to the longest, float32 features and probabilities."""
        longest, rows = max(self.length(s) for s in sequences), len(sequences)
        _, F, H = self.arrays[0].features.shape
        K = self.arrays[0].top_ids.shape[1]
        out = Batch(tokens=np.zeros((rows, longest), np.int64), features=np.zeros((rows, longest, F, H), np.float32),
                    top_ids=np.zeros((rows, longest, K), np.int64), top_probs=np.zeros((rows, longest, K), np.float32),
                    prompt_len=np.zeros(rows, np.int64), length=np.zeros(rows, np.int64))
        for row, sequence in enumerate(sequences):
            shard, s = self.where[sequence]
            a = self.arrays[shard]
            lo, hi = int(a.starts[s]), int(a.starts[s + 1])
            out.tokens[row, : hi - lo], out.features[row, : hi - lo] = a.tokens[lo:hi], a.features[lo:hi]
            out.top_ids[row, : hi - lo], out.top_probs[row, : hi - lo] = a.top_ids[lo:hi], a.top_probs[lo:hi]
            out.prompt_len[row], out.length[row] = int(a.prompts[s]), hi - lo
        return out
