"""The `specdec` and `specdec-export` commands. Heavy modules are imported inside each command."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback

from specdec.cli.export import add_export_args, run_export
from specdec import publish
from specdec.errors import SpecDecError, Terminated


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


def _on_sigterm(signum, frame):
    publish.stop_publishing()
    raise Terminated()


def _fail(args, message: str, hint: str | None) -> int:
    if args.verbose:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)
    return 1


def _run(args) -> int:
    try:
        return args.run(args)
    except SpecDecError as exc:
        return _fail(args, exc.message, exc.hint)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return _fail(args, "the output pipe closed before the output ended (broken pipe)",
                     "expected when the output is piped into a program that stops reading, such as `head`")
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if hasattr(sys.stdout, "reconfigure"):  # text a terminal's encoding cannot show is escaped, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            try:
                code = _run(args)
            except Exception:  # a library turned the Terminated into its own error (transformers' lazy imports do)
                if not publish.stopping():
                    raise
                code = None
            if publish.stopping() and code != 143:  # the Terminated exception was swallowed on its way up
                print("terminated", file=sys.stderr)
                return 143
            return code
        finally:
            signal.signal(signal.SIGTERM, previous)
    return _run(args)


def main(argv: list[str] | None = None) -> int:
    return _dispatch(_build_parser(), argv)


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-export", description="Export HF draft + target to a bundle.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and show tracebacks")
    add_export_args(parser)
    parser.set_defaults(run=run_export)
    return _dispatch(parser, argv)

