"""A random model of a family at a real checkpoint's shape, for step costs where no checkpoint of the family is on the
machine (nothing is downloaded): GPT-2 at gpt2's (124M: 12 layers of 768, 12 heads, MLP 3072, 1024 positions, 50257
tokens). Writes a save_pretrained folder (float32, with specdec's tiny byte-level tokenizer, whose few hundred ids the
vocabulary holds) for `specdec-export --target`; the weights are random, so only costs mean anything, never outputs.

    python benchmarks/random_family.py --family gpt2 --out benchmarks/.models/gpt2-124m
    specdec-export --target benchmarks/.models/gpt2-124m --out bundles/gpt2-124m --weights bf16 --no-draft
    python benchmarks/step.py bundles/gpt2-124m --backends native,onnxruntime --roles target --floor
"""
from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {  # family: (vocabulary, tiny_model's arguments) of the checkpoint's shape
    "gpt2": (50257, dict(layers=12, hidden=768, n_head=12, positions=1024)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from specdec.export.tiny import tiny_model, tiny_tokenizer

    vocab, shape = SHAPES[args.family]
    tokenizer = tiny_tokenizer(320)
    model = tiny_model(args.family, vocab, seed=0, **shape)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote a random {args.family} of {vocab} tokens and {shape} to {args.out}")


if __name__ == "__main__":
    main()
