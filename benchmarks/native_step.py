"""The native backend's target step against the onnxruntime target, in one process: parity with PyTorch and
onnxruntime, then T = 1 and T = 5 calls at one cache length, blocks of calls interleaved between the engines (the
native and the onnxruntime draft's one-token step too), and the steps' products alone (what the forward pass spends
outside them is norms, rotary, attention and SiLU).

    python benchmarks/native_step.py bundles/smollm2-q41 --out benchmarks/results/issue11/native

Needs the export extra (torch, transformers) for the PyTorch reference; the bundle must come from the default
model (make demo's). Not a test; it asserts nothing and writes native.md.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdec.native.model import LINEARS

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def check_parity(native, ort_target, source, new_tokens: int) -> list:
    """-> report lines: last-position logits against PyTorch and onnxruntime, greedy tokens against torch."""
    import torch

    from specdec.export.sources import load_model, load_tokenizer

    model, tokenizer = load_model(source, torch.float32), load_tokenizer(source)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, -1].numpy()
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
    native.reset(1)
    ort_target.reset(1)
    ids = np.array([prompt], np.int64)
    ours = native.forward(ids, np.array([0]))[0, -1]
    theirs = ort_target.forward(ids, np.array([0]))[0, -1]
    tokens = [int(ours.argmax())]
    while len(tokens) < new_tokens:
        step = native.forward(np.array([[tokens[-1]]]), np.array([len(prompt) + len(tokens) - 1]))
        tokens.append(int(step[0, -1].argmax()))
    same = sum(a == b for a, b in zip(tokens, generated.tolist()))
    return [f"- prompt of {len(prompt)} tokens (chat template): max |logit difference| at its last position, "
            f"native − PyTorch {np.abs(ours - reference).max():.2e}, onnxruntime − PyTorch "
            f"{np.abs(theirs - reference).max():.2e}, native − onnxruntime {np.abs(ours - theirs).max():.2e} "
            f"(max |logit| {np.abs(reference).max():.1f})",
            f"- greedy continuation of {new_tokens} tokens on the native backend: {same} identical to PyTorch's "
            "`generate`"]


def kernels_only(model, rows: int) -> None:
    """The step's products (every linear weight and the head, int8 activations for a draft) on constant inputs,
    nothing around them."""
    for i, layer in enumerate(model.weights.layers):
        for j, name in enumerate(LINEARS):
            blocks = getattr(layer, name)
            x = np.ones((rows, blocks.shape[1] * 32), np.float32)
            model.matmul(x, model.pairs[i][j] if model.quant else blocks, model.quant)  # a draft's paired copy
    model.matmul(np.ones((rows, model.head.shape[1] * 32), np.float32), model.head, model.quant)


def measure(backends: dict, cache_len: int, repeats: int, block: int) -> dict:
    cases = {}
    for engine, backend in backends.items():
        backend.reset(1)
        for steps in (1, 5) if "draft" not in engine else (1,):
            ids = np.full((1, steps), 5, np.int64)
            cases[(engine, steps)] = lambda b=backend, i=ids: b.forward(i, np.array([cache_len], np.int64))
    native = backends["native target"].model
    for steps in (1, 5):
        cases[("native kernels alone", steps)] = lambda s=steps: kernels_only(native, s)
    if "native draft" in backends:
        draft = backends["native draft"].model
        cases[("native draft kernels alone", 1)] = lambda: kernels_only(draft, 1)
    samples = {key: [] for key in cases}
    for call in cases.values():
        call()  # warm-up
    for _ in range(repeats):
        for key, call in cases.items():
            for _ in range(block):
                started = time.perf_counter()
                call()
                samples[key].append((time.perf_counter() - started) * 1e3)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="a bundle exported from the default model (make demo's)")
    parser.add_argument("--cache-len", type=int, default=300, help="cache length of the timed calls")
    parser.add_argument("--repeats", type=int, default=8, help="rounds over the engines")
    parser.add_argument("--block", type=int, default=4, help="calls per engine in a round")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens compared with PyTorch")
    parser.add_argument("--out", type=Path, default=None, help="folder for native.md (default: print only)")
    args = parser.parse_args()
    from specdec.export.sources import default_source
    from specdec.manifest import read_manifest
    from specdec.runtime.backend import cpu_count
    from specdec.runtime.native_backend import NativeBackend, drafts_natively
    from specdec.runtime.ort_backend import OrtBackend

    manifest, source = read_manifest(args.bundle), default_source()
    if manifest.target.source.sha256 != source.describe().sha256:
        raise SystemExit(f"{args.bundle} was not exported from the default model ({source.name}); "
                         "Hint: run it on make demo's bundle")
    threads = cpu_count()
    backends = {"native target": NativeBackend(args.bundle, manifest.target, threads).open(),
                "onnxruntime": OrtBackend(args.bundle, manifest.target, threads).open(),
                "onnxruntime draft": OrtBackend(args.bundle, manifest.draft, threads).open()}
    if drafts_natively(manifest.draft, manifest.target):  # the int4-q41 draft on the target's blocks, int8 activations
        backends["native draft"] = NativeBackend(args.bundle, manifest.draft, threads,
                                                 target=backends["native target"]).open()
    lines = check_parity(backends["native target"], backends["onnxruntime"], source, args.new_tokens)
    samples = measure(backends, args.cache_len, args.repeats, args.block)
    lines += ["", f"Calls at cache length {args.cache_len}, {args.repeats} rounds of {args.block} calls per engine, "
              f"interleaved; {threads} threads everywhere (OpenMP in the kernels, onnxruntime's intra-op pool as "
              "specdec sets it).", "", "| engine | T | min ms | median ms |", "|---|---|---|---|"]
    for (engine, steps), values in samples.items():
        name = "onnxruntime target" if engine == "onnxruntime" else engine
        lines.append(f"| {name} | {steps} | {min(values):.1f} | {statistics.median(values):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = f"python benchmarks/native_step.py {args.bundle} --cache-len {args.cache_len}"
        (args.out / "native.md").write_text(f"# The native backend's step against onnxruntime\n\n`{command}`\n\n{text}")


if __name__ == "__main__":
    main()
