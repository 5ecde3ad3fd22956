"""The default model as a K-quant GGUF (Q4_K_M by default), for the native engine's `mixed` layout (issue 39): the
bf16 GGUF (make_bf16_gguf.py, built first where it is missing) quantized by llama.cpp's own `llama-quantize` (built by
setup_llamacpp.sh), as a user's download is made. SmolLM2's 576-wide rows are not a multiple of K-quants' 256, so
llama-quantize gives them its fallbacks (Q5_0 for Q4_K, Q8_0 for Q6_K); the 1536-wide down projections keep Q4_K and
Q6_K. The type counts it wrote are printed.

    python benchmarks/peers/make_kquant_gguf.py [--type Q4_K_M] [--out FILE] [--overwrite]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

from llamacpp_peer import binary, peers_dir

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type (Q4_K_M, Q5_K_M, Q6_K, ...)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/.peers/models/...<type>.gguf")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    models = peers_dir() / "models"
    out = args.out or models / f"SmolLM2-135M-Instruct.{args.type}.gguf"
    if out.exists() and not args.overwrite:
        raise SystemExit(f"{out} exists; pass --overwrite to replace it")
    quantize = binary("llama-quantize")
    if not quantize.is_file():
        raise SystemExit(f"no {quantize}; run benchmarks/peers/setup_llamacpp.sh first")
    source = models / "SmolLM2-135M-Instruct.bf16.gguf"
    if not source.is_file():
        subprocess.run([sys.executable, str(HERE / "make_bf16_gguf.py")], check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(quantize), str(source), str(out), args.type], check=True, stdout=subprocess.DEVNULL)
    from gguf import GGUFReader

    kinds = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(out)).tensors)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {dict(kinds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
