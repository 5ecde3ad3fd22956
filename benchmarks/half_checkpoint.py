"""A half-precision Hugging Face checkpoint of a model specdec-export reads (default: the default model's Q4_1 GGUF),
as most hub models ship: the weights rounded to bfloat16 (or float16) and saved with the tokenizer. Exporting it
(`specdec-export --target OUT`) gives an fp32 graph whose weights the native engine keeps as bf16 rows.

    python benchmarks/half_checkpoint.py --out bundles/smollm2-bf16-hf              # bfloat16, the default model
    python benchmarks/half_checkpoint.py --target path/to/hf --dtype float16 --out half
"""
from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="what specdec-export --target takes (default: the default model)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from specdec.export.sources import load_model, load_tokenizer, resolve_source

    source = resolve_source(args.target)
    model = load_model(source, torch.float32).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    load_tokenizer(source).save_pretrained(args.out)
    print(f"wrote {args.out} ({args.dtype})")


if __name__ == "__main__":
    main()
