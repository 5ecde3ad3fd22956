"""The tiny bundles the cuda device check runs its exactness, distribution and parity checks on (make gpu-bundles):
a tiny LLaMA on the GGUF grids (Q4_1 blocks, a Q8_0 head) and a bf16 one, each exported with native weights and its
int4-q41 draft (head trimmed). They are made here, where the [export] extra is, and carried to the GPU machine
(well under a megabyte each).

Usage: python benchmarks/gpu_bundles.py [OUT]   (default .gpu/bundles)
"""
from __future__ import annotations

import sys
from pathlib import Path

HEAD_TOKENS = 48  # of the tiny vocabulary: the draft's trimmed head leaves tokens out


def tiny_pair(folder: Path, kind: str) -> Path:
    """A gqa bundle of a tiny LLaMA (`kind`: "q41" on the GGUF grids, "q80" on Q8_0 grids throughout, or "bf16"
    rows) with its int4-q41 draft, in folder/kind; the draft bundle's path."""
    from specdec.calibration.bundle_io import quantized_bundle
    from specdec.calibration.data import DataConfig
    from specdec.calibration.quantize import QuantizeConfig
    from specdec.export.bundle import export_bundle
    from specdec.export.config import ExportConfig
    from specdec.export.tiny import save_tiny_in, save_tiny_on_grids
    from specdec.native_record import Activations

    folder = Path(folder)
    options = dict(family="llama", seed=0, init_range=0.5, hidden=64)
    model = (save_tiny_on_grids(folder / f"{kind}-hf", q80=kind == "q80", **options) if kind in ("q41", "q80")
             else save_tiny_in(folder / f"{kind}-hf", "bfloat16", **options))
    config = ExportConfig(out=folder / f"{kind}-target", target=str(model), max_seq_len=128, gamma=3, gamma_max=6,
                          max_batch=4, max_prefill_chunk=16, progress=False, lowering="gqa",
                          draft_from_target="int4", overwrite=True,
                          activations=Activations.FP32)  # what the cuda kernels compute: fp32 activations
    bundle = export_bundle(config)
    quantize = QuantizeConfig(method="int4-q41", data=DataConfig(seq_len=16, num_samples=4), head_tokens=HEAD_TOKENS)
    return quantized_bundle(bundle, folder / kind, quantize)


def main(argv: list) -> int:
    import shutil

    out = Path(argv[0] if argv else ".gpu/bundles")
    work = out.parent / (out.name + ".work")
    out.mkdir(parents=True, exist_ok=True)
    for kind in ("q41", "bf16"):
        made = tiny_pair(work, kind)
        shutil.rmtree(out / kind, ignore_errors=True)
        shutil.copytree(made, out / kind)
    shutil.rmtree(work)
    print(f"wrote {', '.join(str(out / k) for k in ('q41', 'bf16'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
