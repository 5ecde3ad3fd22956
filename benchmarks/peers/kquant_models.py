"""K-quant GGUFs as llama-quantize writes them for rows a multiple of 256 (most 1B+ models; the default model's 576
are not, so its Q4_K_M file holds llama-quantize's Q5_0 / Q8_0 fallbacks instead): a random Llama of SmolLM2's
tokenizer with hidden size 512 (8 heads of 64, 2 KV heads, MLP 1024, 2 layers), converted by llama.cpp's
convert_hf_to_gguf.py to f32 and quantized by llama-quantize to each --types value, then exported by specdec-export.
Prints, per type: the GGUF's tensor types, the native layout and block kinds export chose (a Q4_K_M's q/k Q4_K beside
v Q6_K keep their v rows apart: `qkv_v`), the manifest's native_note, which backend `load` opened and its
backend_note, and whether native greedy output equals onnxruntime's (32 tokens, 4 prompts). Needs
setup_llamacpp.sh's tree and build (llama-quantize) and make_bf16_gguf.py's hf-bf16 folder (the tokenizer).

    python benchmarks/peers/kquant_models.py [--types Q4_K_M,Q5_K_M,Q6_K,IQ4_NL] [--out DIR]
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from llamacpp_peer import binary, peers_dir
from make_bf16_gguf import converter

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Speculative decoding is"]


def tiny_llama(folder: Path) -> Path:
    """A random 512-wide Llama with the default model's tokenizer, saved in float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = peers_dir() / "models" / "hf-bf16"
    if not (source / "tokenizer.json").is_file():
        raise SystemExit(f"no {source}; run benchmarks/peers/make_bf16_gguf.py first")
    config = AutoConfig.from_pretrained(source)
    config.update(dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, dtype="float32"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def describe(bundle: Path, gguf: Path) -> None:
    import numpy as np
    from gguf import GGUFReader

    from specdec import GenerationConfig, load
    from specdec.manifest import read_manifest

    print(f"  GGUF types: {dict(Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors))}")
    target = read_manifest(bundle).target
    native = target.native
    kinds = Counter(spec["kind"] for spec in native.tensors.values()) if native else {}
    split = sorted(name for name in (native.tensors if native else {}) if name.endswith("qkv_v"))
    print(f"  native layout: {native and native.layout}; kinds {dict(kinds)}; v rows apart: {split or 'none'}")
    print(f"  native_note: {target.native_note or '-'}")
    config = GenerationConfig(max_new_tokens=32, drafter="none")
    outputs = {}
    for backend in ("auto", "onnxruntime"):
        with load(bundle, backend=backend) as gen:
            if backend == "auto":
                print(f"  auto opened {gen.backend}; backend_note: {gen.backend_note or '-'}")
            outputs[backend] = [gen.generate(p, config).token_ids for p in PROMPTS]
    same = sum(np.array_equal(a, b) for a, b in zip(outputs["auto"], outputs["onnxruntime"]))
    print(f"  greedy outputs identical to onnxruntime's: {same}/{len(PROMPTS)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,IQ4_NL")
    parser.add_argument("--out", type=Path, default=peers_dir() / "kquant")
    args = parser.parse_args(argv)
    quantize = binary("llama-quantize")
    if not quantize.is_file():
        raise SystemExit(f"no {quantize}; run benchmarks/peers/setup_llamacpp.sh first")
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.out / "hf-512"
    if not (folder / "config.json").is_file():
        tiny_llama(folder)
    f32 = args.out / "tiny-512.f32.gguf"
    if not f32.is_file():
        subprocess.run([sys.executable, str(converter()), str(folder), "--outtype", "f32", "--outfile", str(f32)],
                       check=True, stdout=subprocess.DEVNULL)
    for kind in (part.strip() for part in args.types.split(",") if part.strip()):
        gguf = args.out / f"tiny-512.{kind}.gguf"
        subprocess.run([str(quantize), str(f32), str(gguf), kind], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        bundle = args.out / f"bundle-{kind}"
        subprocess.run([str(Path(sys.executable).parent / "specdec-export"), "--target", str(gguf), "--out", str(bundle),
                        "--max-seq-len", "256", "--no-draft", "--overwrite"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        print(f"{kind}:")
        describe(bundle, gguf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
