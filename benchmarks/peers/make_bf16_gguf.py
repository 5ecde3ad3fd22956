"""The default model as a bf16 GGUF, for issue 30's bf16 comparison with llama.cpp (its draft: the default Q4_1 GGUF,
which shares the tokenizer).

1. transformers loads the default Q4_1 GGUF (`gguf_file=`, dequantized, as specdec's export does) in bfloat16, and
   saves a Hugging Face folder: benchmarks/.peers/models/hf-bf16/ (the weights `specdec-export --weights bf16`
   exports: the Q4_1 values rounded to bf16);
2. llama.cpp's own converter, `convert_hf_to_gguf.py --outtype bf16` from the tree setup_llamacpp.sh unpacked (its
   gguf-py beside it), writes benchmarks/.peers/models/SmolLM2-135M-Instruct.bf16.gguf.

Runs in specdec's venv (torch, transformers, numpy, sentencepiece; the converter's other imports are its own tree).

    python benchmarks/peers/make_bf16_gguf.py [--out FILE] [--overwrite]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from llamacpp_peer import default_gguf, peers_dir


def converter() -> Path:
    trees = (peers_dir() / "llama.cpp" / "src").glob("llama_cpp_python-*/vendor/llama.cpp")
    found = sorted(tree / "convert_hf_to_gguf.py" for tree in trees if (tree / "convert_hf_to_gguf.py").is_file())
    if not found:
        raise SystemExit("llama.cpp's tree is not unpacked; run benchmarks/peers/setup_llamacpp.sh first")
    return found[-1]


def hf_bf16(folder: Path) -> Path:
    """The default GGUF dequantized by transformers, saved in bfloat16 with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # a GGUF arrives dequantized; save no quantizer state
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(peers_dir() / "models" / "SmolLM2-135M-Instruct.bf16.gguf"))
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if out.is_file() and not args.overwrite:
        print(f"exists: {out} (--overwrite to rebuild)")
        return 0
    folder = out.parent / "hf-bf16"
    if args.overwrite or not (folder / "config.json").is_file():
        hf_bf16(folder)
    command = [sys.executable, str(converter()), str(folder), "--outtype", "bf16", "--outfile", str(out)]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
