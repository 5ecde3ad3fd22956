"""The `specdec` and `specdec-export` commands. Heavy modules are imported inside each command."""
from __future__ import annotations

import argparse
import logging
import sys
import traceback

from specdec.cli.export import add_export_args, run_export
from specdec.errors import SpecDecError


def _run_inspect(args) -> int:
    from specdec.cli.describe import describe_bundle

    print(describe_bundle(args.bundle, verify=not args.no_verify))
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding on static-KV engines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="export HF models to a bundle (same as specdec-export)")
    add_export_args(export)
    export.set_defaults(run=run_export)
    inspect = commands.add_parser("inspect", help="describe a bundle")
    inspect.add_argument("bundle")
    inspect.add_argument("--no-verify", action="store_true", help="skip checking file hashes")
    inspect.set_defaults(run=_run_inspect)
    from specdec.cli.generate import add_generate_parser

    add_generate_parser(commands)
    from specdec.cli.bench import add_bench_parser

    add_bench_parser(commands)
    from specdec.cli.calibrate import add_calibrate_parser

    add_calibrate_parser(commands)
    from specdec.cli.serve import add_serve_parser

    add_serve_parser(commands)
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
    add_export_args(parser)
    parser.set_defaults(run=run_export)
    return _dispatch(parser, argv)

