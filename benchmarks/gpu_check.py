"""`python benchmarks/gpu_check.py BUNDLE OUT`: TensorRT against onnxruntime CPU on one bundle, on a GPU.

Writes OUT/<name>.json and prints a summary:
- logits: max |TensorRT - onnxruntime| / max |logit| over a prefill and greedy decode steps of each prompt;
- exactness: greedy speculative output on TensorRT equals target-only greedy output on TensorRT (must hold);
- agreement: TensorRT target-only greedy output equals onnxruntime CPU's, prompt by prompt (fp32 plans built
  without TF32 should agree; a near-tie can still flip a token, so the first divergence is reported);
- latency: ms per generated token on TensorRT with and without CUDA graphs, per drafter.
A benchmark, not a test: it asserts no timings. Exit code 1 only if exactness fails.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from harness import tables, timer
from specdec.manifest import read_manifest
from specdec.runtime.ort_backend import OrtBackend
from specdec.runtime.config import GenerationConfig
from specdec.runtime.generator import Generator
from specdec.runtime.text import TextCodec
from specdec.runtime.trt_backend import TrtBackend, TrtOptions

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time there was a tiny model that wanted to speak.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]


def logits_gap(trt, ort, ids: list, steps: int) -> float:
    """Feed the prompt, then `steps` greedy tokens, through both backends; -> max relative logits gap."""
    worst = 0.0
    for backend in (trt, ort):
        backend.reset(1)
    feed, start = np.asarray([ids], dtype=np.int64), 0  # [1, T]
    for _ in range(steps + 1):
        cache_len = np.asarray([start], dtype=np.int64)  # [1]
        a, b = trt.forward(feed, cache_len), ort.forward(feed, cache_len)  # [1, T, V]
        worst = max(worst, float(np.abs(a - b).max() / max(1e-6, np.abs(b).max())))
        start += feed.shape[1]
        feed = b[:, -1:].argmax(axis=-1).astype(np.int64)  # [1, 1]
    return worst


def _generator(root: Path, manifest, graphs: bool) -> Generator:
    options = TrtOptions(cuda_graphs=graphs)
    target = TrtBackend(root, manifest.target, options).open()
    draft = None
    if manifest.draft is not None and manifest.draft.engines:
        draft = TrtBackend(root, manifest.draft, options).open()
    return Generator(manifest, TextCodec(root).open(), target, draft)


def _ort_generator(root: Path, manifest) -> Generator:
    draft = OrtBackend(root, manifest.draft).open() if manifest.draft is not None else None
    return Generator(manifest, TextCodec(root).open(), OrtBackend(root, manifest.target).open(), draft)


def _outputs(gen: Generator, drafter: str, new_tokens: int) -> list:
    config = GenerationConfig(max_new_tokens=new_tokens, drafter=drafter)
    return [gen.generate(p, config).token_ids for p in PROMPTS]


def _first_divergence(a: list, b: list) -> int:
    """Index of the first differing token; -1 when equal."""
    same_length = -1 if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), same_length)


def _latency(gen: Generator, drafters: list, new_tokens: int, repeats: int) -> dict:
    """Median ms per generated token, per drafter (interleaved repeats; one warm-up pass first)."""
    samples = {d: [] for d in drafters}
    for repeat in range(repeats + 1):
        for prompt in PROMPTS:
            for drafter in drafters:
                config = GenerationConfig(max_new_tokens=new_tokens, drafter=drafter)
                result, seconds = timer.timed(lambda: gen.generate(prompt, config))
                if repeat:  # the first pass captures the CUDA graphs
                    samples[drafter].append(seconds * 1e3 / max(1, len(result.token_ids)))
    return {d: round(timer.summarize(v).median, 3) for d, v in samples.items()}


def check_bundle(root: Path, new_tokens: int, repeats: int) -> dict:
    manifest = read_manifest(root)
    drafters = ["none", "prompt_lookup"] + (["model", "auto"] if manifest.draft and manifest.draft.engines else [])
    ort = _ort_generator(root, manifest)
    trt = _generator(root, manifest, graphs=True)
    codec = trt.codec
    report = {"bundle": str(root), "engines": {r: [e.path for e in m.engines] for r, m in manifest.models.items()}}
    report["logits_max_rel_gap"] = max(
        logits_gap(trt.target.backend, ort.target.backend, codec.encode(p), 8) for p in PROMPTS)
    plain_trt, plain_ort = _outputs(trt, "none", new_tokens), _outputs(ort, "none", new_tokens)
    report["agreement_trt_vs_ort"] = [_first_divergence(a, b) for a, b in zip(plain_trt, plain_ort, strict=True)]
    report["exact"] = {d: _outputs(trt, d, new_tokens) == plain_trt for d in drafters}
    report["replays_with_graphs"] = trt.target.backend.replays
    report["ms_per_token_graphs"] = _latency(trt, drafters, new_tokens, repeats)
    trt.close()
    eager = _generator(root, manifest, graphs=False)
    report["ms_per_token_no_graphs"] = _latency(eager, drafters, new_tokens, repeats)
    report["exact_no_graphs"] = _outputs(eager, "none", new_tokens) == plain_trt
    eager.close()
    ort.close()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("out")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    root, out = Path(args.bundle), Path(args.out)
    report = check_bundle(root, args.new_tokens, args.repeats)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    tables.write_text(out / f"{root.name}.json", text)
    print(text)
    exact = all(report["exact"].values()) and report["exact_no_graphs"]
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
