"""A copy of a bundle whose trained draft head scores fewer tokens: its draft vocabulary cut to the N tokens of most
label mass (the target's top-k probabilities summed over the run's training data, as `specdec calibrate head` ranks
them when it picks the vocabulary), its LM head cut to their rows; every other weight as it was. What a smaller
draft vocabulary costs in acceptance and saves in a head step, without training again (docs/heads.md).

    python benchmarks/trim_head.py bundles/smollm2-q41-head 4096 --out bundles/smollm2-q41-head4k
    python benchmarks/trim_head.py BUNDLE N --out OUT --work BUNDLE.head-train    # the training run's work folder

The work folder (default: BUNDLE.head-train, where `specdec calibrate head --out BUNDLE` left it) must hold the data
the head was trained on. The bundle's EOS tokens the head scores are kept whatever their mass.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import numpy as np

from specdec.errors import SpecDecError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("tokens", type=int, help="draft tokens to keep (at most the head's)")
    parser.add_argument("--out", type=Path, required=True, help="the trimmed copy (must not exist)")
    parser.add_argument("--work", type=Path, default=None, help="the training run's work folder")
    return parser.parse_args(argv)


def trim(bundle: Path, tokens: int, out: Path, work: Path) -> tuple:
    """Write `out`; -> (draft tokens kept, their share of the data's label mass, the full head's share)."""
    from specdec.calibration.head_train.init import draft_vocabulary, label_mass
    from specdec.calibration.head_train.shards import Shards
    from specdec.head.format import attach_head, read_head
    from specdec.manifest import check_bundle_files, read_manifest

    manifest = read_manifest(bundle)
    record = manifest.head
    if record is None:
        raise SystemExit(f"error: {bundle} has no draft head\nHint: train one (specdec calibrate head)")
    if not 1 <= tokens <= record.draft_vocab_size:
        raise SystemExit(f"error: {tokens} draft tokens: the head has {record.draft_vocab_size}\n"
                         f"Hint: pass 1..{record.draft_vocab_size}")
    shards = Shards(work / "data") if (work / "data").is_dir() else []
    if not len(shards):
        raise SystemExit(f"error: {work / 'data'} holds no training data\nHint: pass --work, the folder of the run "
                         "that trained the head")
    if out.exists():
        raise SystemExit(f"error: {out} exists\nHint: pass another --out, or remove it")
    check_bundle_files(bundle, manifest, sorted({record.path, *record.files}))
    weights = read_head(bundle, record)
    mass = label_mass(shards, record.vocab_size)
    scored = np.where(np.isin(np.arange(len(mass)), weights.draft_ids), mass, -1.0)  # only the head's own tokens
    eos = [t for t in manifest.tokenizer.eos_token_ids if t in weights.draft_ids]  # (an imported head may score no
    # EOS: it cannot gain one here)
    kept = draft_vocabulary(scored, tokens, eos)
    rows = np.searchsorted(weights.draft_ids, kept)  # draft_ids are sorted, and hold every kept id
    shutil.copytree(bundle, out)
    trimmed = dataclasses.replace(weights, lm_head=np.ascontiguousarray(weights.lm_head[rows]), draft_ids=kept)
    attach_head(out, trimmed, dataclasses.replace(record, draft_vocab_size=len(kept),
                                                  source=f"{record.source}; trimmed to {len(kept)} draft tokens"))
    total = mass.sum()
    return len(kept), float(mass[kept].sum() / total), float(mass[weights.draft_ids].sum() / total)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.work or args.bundle.with_name(args.bundle.name + ".head-train")
    try:
        kept, share, full = trim(args.bundle, args.tokens, args.out, work)
    except SpecDecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {kept} draft tokens, {share:.4f} of the training data's label mass ({full:.4f} with "
          "every token of the head)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
