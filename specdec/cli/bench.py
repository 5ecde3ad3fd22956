"""`specdec bench BUNDLE`: latency per mode on the committed prompt sets; tables, markdown and plots in --out."""
from __future__ import annotations

import argparse
import shlex
import sys

from specdec.bench.config import BENCH_DRAFTERS
from specdec.native_record import ACTIVATIONS, ACTIVATIONS_HELP
from specdec.runtime.config import NAMED_BACKENDS, BackendName

DEFAULT_BACKEND = BackendName.ONNXRUNTIME  # every bundle
DEFAULT_PROMPTS = "benchmarks/prompts"


def _ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _names(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_bench_parser(commands) -> None:
    parser = commands.add_parser("bench", help="benchmark a bundle's decoding modes (needs specdec[bench])")
    parser.add_argument("bundle")
    parser.add_argument("--out", default="bench-results", help="output folder (default bench-results)")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="folder of *.jsonl prompt sets, or one file")
    parser.add_argument("--per-class", type=int, default=0, help="prompts per class (default 0: all)")
    parser.add_argument("--new-tokens", type=int, default=96, help="max new tokens per request (default 96)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests per mode (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--drafters", type=_names, default=BENCH_DRAFTERS,
                        help=f"comma-separated drafters besides target-only (default {','.join(BENCH_DRAFTERS)}; "
                             "head: the bundle's draft head)")
    parser.add_argument("--gammas", type=_ints, default=(1, 2, 4, 6, 8), help="γ sweep of the model and auto drafters")
    parser.add_argument("--gamma-policies", type=_names, default=(),
                        help="γ policies of the model drafter to add: adaptive,heuristic (default none)")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--backend", choices=NAMED_BACKENDS, default=DEFAULT_BACKEND,
                        help="onnxruntime (default); native: specdec's own CPU kernels; cuda: specdec's own GPU "
                             "kernels (cuda:0)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default=None, help=ACTIVATIONS_HELP)
    parser.add_argument("--peers", default=None, help="folder of peer results (*.jsonl) to merge into the table")
    parser.add_argument("--quick", action="store_true", help="smoke run: shortest prompt per class, 12 tokens, "
                        "one repeat, γ in {1, 2}")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-verify", action="store_true", help="skip checking the bundle's file hashes")
    parser.set_defaults(run=run_bench_command)


def config_from_args(args: argparse.Namespace):
    from specdec.bench.config import BenchConfig

    common = dict(prompts=args.prompts, seed=args.seed, temperature=args.temperature, drafters=args.drafters,
                  policies=args.gamma_policies,
                  threads=args.threads, backend=args.backend, verify=not args.no_verify, peers=args.peers,
                  activations=args.activations,
                  plots=not args.no_plots,
                  progress=not args.no_progress and sys.stderr.isatty())
    if args.quick:
        return BenchConfig.quick(args.bundle, args.out, **common)
    return BenchConfig(bundle=args.bundle, out=args.out, per_class=args.per_class, max_new_tokens=args.new_tokens,
                       repeats=args.repeats, warmup=args.warmup, gammas=args.gammas, **common)


def command_from_args(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (recorded in the summary)."""
    parts = ["specdec", "bench", args.bundle, "--out", args.out]
    if args.quick:
        parts.append("--quick")
    else:
        parts += ["--per-class", str(args.per_class), "--new-tokens", str(args.new_tokens), "--repeats",
                  str(args.repeats), "--warmup", str(args.warmup), "--gammas", ",".join(map(str, args.gammas))]
    parts += ["--drafters", ",".join(args.drafters)]
    if args.gamma_policies:
        parts += ["--gamma-policies", ",".join(args.gamma_policies)]
    for flag, value, default in (("--prompts", args.prompts, DEFAULT_PROMPTS), ("--threads", args.threads, None),
                                 ("--peers", args.peers, None)):
        if value is not None and value != default:
            parts += [flag, str(value)]
    if BackendName(args.backend) is not DEFAULT_BACKEND:
        parts += ["--backend", args.backend]
    if args.activations:
        parts += ["--activations", args.activations]
    if args.temperature:
        parts += ["--temperature", str(args.temperature), "--seed", str(args.seed)]
    return " ".join(shlex.quote(p) for p in parts)


def run_bench_command(args: argparse.Namespace) -> int:
    from specdec.bench import run_bench

    config = config_from_args(args)
    paths = run_bench(config, command=command_from_args(args))
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
