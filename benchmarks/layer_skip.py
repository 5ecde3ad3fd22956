"""Would a layer-skipping self-draft pay? Top-1 agreement with the full model when one decoder layer is left out.

    python benchmarks/layer_skip.py bundles/smollm2-q41 --per-class 2 --continue 96     # needs specdec[export]

The bundle's source model (PyTorch, fp32) scores each benchmark prompt extended by the bundle target's greedy
continuation; with layer i removed it scores the same sequences again, and the table gives, per i, the share of
continuation positions whose argmax is unchanged. A draft without one of L layers costs about (L − 1)/L of the
full one; with the draft's cost c ≈ 0.3 of the target's, acceptance near 0.95, γ = 4 and r = 1.3, one layer
fewer pays only while agreement stays above about 0.95 (DESIGN §1). Prints markdown; no assertions (not a test).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from draft_agreement import add_prompt_args, continuations
from specdec.manifest import read_manifest
from specdec.runtime.ort_backend import OrtBackend


def argmaxes(model, sequences: list, torch) -> list:
    with torch.no_grad():
        return [model(torch.tensor([seq]), use_cache=False).logits[0].argmax(-1).numpy() for seq, _ in sequences]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    add_prompt_args(parser, per_class=2, steps=96)
    args = parser.parse_args()
    import torch

    from specdec.export.sources import ModelSource, load_model

    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    manifest = read_manifest(args.bundle)
    target = OrtBackend(args.bundle, manifest.target).open()
    sequences = continuations(target, args.bundle, args)
    target.close()
    source = manifest.target.source
    model = load_model(ModelSource(source.kind, Path(source.path), source.gguf_file, source.name), torch.float32)
    model.eval()
    full = argmaxes(model, sequences, torch)
    layers = list(model.model.layers)
    positions = sum(len(seq) - start + 1 for seq, start in sequences)
    print(f"**{args.bundle.name}**: {len(sequences)} prompts, {positions} continuation positions, fp32 source model "
          f"({len(layers)} layers); agreement of the model without layer i with the full model\n")
    print("| layer left out | top-1 agreement |\n|---|---|")
    for skipped in range(len(layers)):
        model.model.layers = torch.nn.ModuleList(layers[:skipped] + layers[skipped + 1:])
        model.config.num_hidden_layers = len(layers) - 1
        agree = sum(int((a[start - 1:] == b[start - 1:]).sum())
                    for a, b, (_, start) in zip(argmaxes(model, sequences, torch), full, sequences))
        print(f"| {skipped} | {agree / positions:.3f} |", flush=True)
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = len(layers)


if __name__ == "__main__":
    main()
