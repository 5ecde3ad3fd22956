"""`specdec calibrate quantize | gamma | report | policies | head`: quantized bundles, γ calibration, quality tables,
a draft head."""
from __future__ import annotations

import argparse
import sys

from specdec.calibration.bundle_io import SOURCES
from specdec.calibration.head_train.config import PRECISIONS, Precision
from specdec.calibration.quantize import BACKENDS, METHODS, MINIMUMS, ROLES
from specdec.errors import ConfigError
from specdec.manifest import Role
from specdec.native_record import ACTIVATIONS
from specdec.runtime.config import BackendName


def _add_data_args(parser: argparse.ArgumentParser, seq_len: int, samples: int) -> None:
    group = parser.add_argument_group("calibration data")
    group.add_argument("--data", default="builtin", help="a .txt/.md, .jsonl or .parquet file, or 'builtin' (default)")
    group.add_argument("--field", default="text", help="text field of JSONL / parquet rows (default text)")
    group.add_argument("--seq-len", type=int, default=seq_len, help=f"tokens per window (default {seq_len})")
    group.add_argument("--samples", type=int, default=samples, help=f"windows to use (default {samples})")
    group.add_argument("--held-out", type=float, default=0.25, help="fraction of texts held out (default 0.25)")


def add_calibrate_parser(commands) -> None:
    parser = commands.add_parser("calibrate", help="quantize models, calibrate γ, report quality")
    actions = parser.add_subparsers(dest="action", required=True)
    quantize = actions.add_parser("quantize", help="a copy of BUNDLE with its draft or target quantized")
    quantize.add_argument("bundle")
    quantize.add_argument("--method", required=True, choices=tuple(method.value for method in METHODS))
    quantize.add_argument("--out", required=True, help="bundle directory to write")
    quantize.add_argument("--role", choices=ROLES, default=Role.DRAFT, help="model to replace (default draft)")
    quantize.add_argument("--source", choices=SOURCES, default=Role.TARGET,
                          help="the bundle's fp32 model to quantize (default target); draft: its own fp32 draft, "
                               "e.g. a --draft-layers K draft, which then needs --role draft")
    quantize.add_argument("--backend", choices=tuple(name.value for name in BACKENDS),
                          default=BackendName.ONNXRUNTIME,
                          help="the back end that will run the model (default onnxruntime)")
    quantize.add_argument("--accuracy-level", type=int, default=4, help="MatMulNBits compute: 4 int8 (default), 1 fp32")
    quantize.add_argument("--head-tokens", type=int, default=0,
                          help="int4-q41 draft: LM head over the N tokens the target most often emits on the "
                               "calibration text (default 0: every token)")
    quantize.add_argument("--q41-minimum", choices=MINIMUMS, default=None,
                          help="int4-q41: how the Q4_1 float minimum is added back: rows (default: 4-bit rows of the "
                               "same MatMulNBits, fed the activations' block sums; faster) or exact (an fp32 "
                               "correction MatMul and Add: the weights bit for bit)")
    quantize.add_argument("--verify-len", type=int, default=5, help="T of verify-shaped calibration feeds (default 5)")
    quantize.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    _add_data_args(quantize, 64, 16)
    quantize.set_defaults(run=run_quantize)
    gamma = actions.add_parser("gamma", help="measure acceptance and c; write the best γ into the manifest")
    gamma.add_argument("bundle")
    _add_run_args(gamma, 128)
    gamma.add_argument("--gamma-max", type=int, default=None, help="largest γ to consider (default: the bundle's)")
    gamma.add_argument("--paper-cost", action="store_true",
                       help="the paper's cost model, a γ+1 verify pass costs one target step (default: the measured "
                            "cost of each verify length)")
    gamma.add_argument("--dry-run", action="store_true", help="print the choice without writing the manifest")
    gamma.set_defaults(run=run_gamma)
    _add_report_parser(actions)
    policies = actions.add_parser("policies", help="tokens/s of fixed, calibrated and adaptive γ policies")
    policies.add_argument("bundle")
    _add_run_args(policies)
    policies.set_defaults(run=run_policies)
    _add_head_parser(actions)


def _add_head_parser(actions) -> None:
    head = actions.add_parser("head", help="give BUNDLE a trained draft head (EAGLE-3 style): train one from the "
                                           "target (PyTorch, on the CPU), or attach a checkpoint --from DIR")
    head.add_argument("bundle")
    head.add_argument("--from", dest="checkpoint", metavar="DIR",
                      help="an EAGLE-3 checkpoint directory in SpecForge's or vllm-project/speculators' layout "
                           "(config.json and safetensors), or another bundle of the same model that has a head "
                           "(its head is copied); the bundle's head is replaced (docs/heads.md)")
    train = head.add_argument_group("training (without --from)")
    train.add_argument("--out", help="write a copy of BUNDLE with the trained head here (default: BUNDLE itself)")
    train.add_argument("--work", help="data and checkpoints (default: beside the output, NAME.head-train)")
    train.add_argument("--resume", action="store_true", help="continue the run in --work (its data, its checkpoint)")
    train.add_argument("--overwrite", action="store_true", help="replace --out and start --work again")
    train.add_argument("--minutes", type=float, help="wall-clock budget of the whole run (data, then training)")
    train.add_argument("--data-tokens", type=int, default=300_000, help="answer tokens the target writes as data "
                                                                         "(default 300000)")
    train.add_argument("--steps", type=int, help="training steps (default: --epochs passes over the data, or what "
                                                 "--minutes leaves)")
    train.add_argument("--epochs", type=float, default=2.0, help="passes over the data (default 2)")
    train.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size V' (default 4096)")
    train.add_argument("--max-new-tokens", type=int, default=192, help="tokens per answer (default 192)")
    train.add_argument("--rows", type=int, default=16, help="prompts the target answers at once (default 16)")
    train.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    train.add_argument("--seed", type=int, default=0, help="prompts, sampling and training order (default 0)")
    train.add_argument("--activations", choices=ACTIVATIONS,
                       help="the target's activations while it writes the data (default: the bundle's, those the head "
                            "drafts from when it runs)")
    train.add_argument("--threads", type=int, help="threads (default: the cores this process may use)")
    train.add_argument("--asked-share", type=float, default=0.0,
                       help="the share of prompts the target writes itself (fed its chat template up to a user's "
                            "message, it samples one), the others templated; default 0")
    train.add_argument("--precision", choices=PRECISIONS,
                       help="the training's products: bf16 (torch autocast; weights, optimizer and softmax stay fp32), "
                            "fp32, or auto (default): bf16 where the CPU has amx_bf16 or avx512_bf16")
    head.set_defaults(run=run_head)


TRAIN_FLAGS = ("asked_share", "precision", "activations", "out", "work", "resume", "overwrite", "minutes",
               "steps")  # refused beside --from


def _add_report_parser(actions) -> None:
    report = actions.add_parser("report", help="quality table of quantized models (markdown; --csv for CSV)")
    report.add_argument("bundles", nargs="+")
    report.add_argument("--reference", required=True, help="bundle whose fp32 target is the reference")
    report.add_argument("--out", help="write the markdown table here (default: stdout)")
    report.add_argument("--csv", help="also write the table as CSV")
    report.add_argument("--overwrite", action="store_true", help="replace existing --out / --csv files")
    _add_run_args(report)
    _add_data_args(report, 32, 16)
    report.set_defaults(run=run_report)


def _add_run_args(parser: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    parser.add_argument("--prompt", action="append", default=[], help="a calibration prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                        help=f"tokens per prompt (default {max_new_tokens})")


def _data(args):
    from specdec.calibration.data import DataConfig

    return DataConfig(source=args.data, field=args.field, seq_len=args.seq_len, num_samples=args.samples,
                      held_out=args.held_out)


def _prompts(args) -> tuple:
    from specdec.calibration.quality import DEFAULT_PROMPTS

    return tuple(args.prompt) or DEFAULT_PROMPTS


def run_quantize(args) -> int:
    from specdec.calibration.bundle_io import quantized_bundle
    from specdec.calibration.quantize import QuantizeConfig

    config = QuantizeConfig(method=args.method, role=args.role, backend=args.backend, data=_data(args),
                            verify_len=args.verify_len, accuracy_level=args.accuracy_level,
                            head_tokens=args.head_tokens, q41_minimum=args.q41_minimum,
                            progress=sys.stderr.isatty() or args.verbose)
    out = quantized_bundle(args.bundle, args.out, config, overwrite=args.overwrite, source=args.source)
    print(f"wrote bundle {out} ({args.role} = {args.source} quantized with {args.method})", file=sys.stderr)
    return 0


def run_gamma(args) -> int:
    from specdec.calibration.gamma import GammaConfig, calibrate_gamma, tune_gamma

    config = GammaConfig(prompts=_prompts(args), max_new_tokens=args.max_new_tokens, gamma_max=args.gamma_max,
                         with_verify_cost=not args.paper_cost, progress=sys.stderr.isatty() or args.verbose)
    result = (tune_gamma if args.dry_run else calibrate_gamma)(args.bundle, config)
    print(f"c = {result.cost_ratio:.3f} (draft/target step), rounds = {result.rounds}")
    print("γ  A_γ    α_γ    r(γ)   expected speedup")
    rows = zip(result.cumulative, result.alphas, result.verify_cost, result.speedups)
    for g, (a, alpha, r, s) in enumerate(rows, 1):
        print(f"{g:<2} {a:.3f}  {alpha:.3f}  {r:.2f}   {s:.2f}{'  <- chosen' if g == result.gamma else ''}")
    print(f"γ = {result.gamma}" + (" (dry run: manifest unchanged)" if args.dry_run else " written to defaults.gamma"))
    return 0


def run_report(args) -> int:
    from specdec.calibration.quality import csv_table, markdown_table
    from specdec.calibration.report import ReportConfig, quality_report
    from specdec.publish import check_output_file, write_atomic

    outputs = {flag: check_output_file(value, args.overwrite, flag) for flag, value in (("--out", args.out),
                                                                                        ("--csv", args.csv)) if value}
    if len(outputs) == 2 and outputs["--out"].resolve() == outputs["--csv"].resolve():
        raise ConfigError(f"--out and --csv are the same file {args.out!r}", "pass two different files")
    config = ReportConfig(reference=args.reference, data=_data(args), prompts=_prompts(args),
                          max_new_tokens=args.max_new_tokens, progress=sys.stderr.isatty() or args.verbose)
    rows = quality_report(args.bundles, config)
    table = markdown_table(rows)
    if args.out:
        write_atomic(outputs["--out"], table)
    else:
        sys.stdout.write(table)
    if args.csv:
        write_atomic(outputs["--csv"], csv_table(rows))
    return 0


def run_policies(args) -> int:
    from specdec.calibration.policies import compare_policies

    results = compare_policies(args.bundle, list(_prompts(args)), args.max_new_tokens, sys.stderr.isatty() or args.verbose)
    print("| policy | tok/s | acceptance | MAL | greedy = plain |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.tokens_per_s:.1f} | {r.acceptance_rate:.3f} | {r.mean_acceptance_length:.2f} | "
              f"{'yes' if r.matches_plain else 'NO'} |")
    return 0


def run_head(args) -> int:
    if args.checkpoint is None:
        return _train_head(args)
    given = [f"--{flag.replace('_', '-')}" for flag in TRAIN_FLAGS if getattr(args, flag) not in (None, False)]
    if given:
        raise ConfigError(f"{given[0]} is an option of training, and --from attaches a trained head",
                          f"drop {given[0]}, or drop --from to train a head from the target")
    from specdec.export.head_import import attach_checkpoint

    record = attach_checkpoint(args.bundle, args.checkpoint)
    print(f"wrote the draft head of {args.bundle} ({record.draft_vocab_size} draft tokens, target layers "
          f"{record.feature_layers}); generate with --drafter head", file=sys.stderr)
    return 0


def _train_head(args) -> int:
    from specdec.calibration.head_train.config import HeadTrainConfig
    from specdec.calibration.head_train.pipeline import train_head

    config = HeadTrainConfig(out=args.out, work=args.work, resume=args.resume, overwrite=args.overwrite,
                             minutes=args.minutes, data_tokens=args.data_tokens, max_new_tokens=args.max_new_tokens,
                             rows=args.rows, draft_vocab=args.draft_vocab, steps=args.steps, epochs=args.epochs,
                             lr=args.lr, seed=args.seed, activations=args.activations, threads=args.threads,
                             precision=args.precision or Precision.AUTO, asked_share=args.asked_share)
    summary = train_head(args.bundle, config, progress=sys.stderr.isatty() or args.verbose)
    data, training = summary["data"], summary["training"]
    agreement = " ".join(f"{a:.3f}" for a in training["held_out_agreement"])
    print(f"wrote the draft head of {args.out or args.bundle}: {data['answer_tokens']} answer tokens, "
          f"{training['steps']} steps ({training['epochs']:.2f} epochs, {training['precision']}), "
          f"{training['draft_vocab']} draft tokens, "
          f"{summary['minutes']:.1f} min; held-out top-1 agreement per draft step {agreement}; generate with "
          "--drafter head", file=sys.stderr)
    return 0
