"""A kernel change, measured: forwards of one model on two builds of the native engine's C sources in one process,
calls interleaved (which build goes first alternates), so the machine's drift falls on both alike.

    python benchmarks/native_ab.py bundles/smollm2-q41 HEAD~1                 # this tree against a commit's sources
    python benchmarks/native_ab.py bundles/smollm2-q41 /tmp/other --role target --tokens 5 --rows 4

OLD: a git commit (its specdec/native/*.c and *.h) or a folder holding the sources. Both builds must export the ABI
this specdec reads (specdec_native.h); older sources are refused. At cache lengths 64 / 512 / 1000 (a random prompt
prefilled by the target): forwards of --tokens tokens for --rows rows of the role (a prompt's chunk, last row
scored, where tokens > --verify-rows; else every row scored, as a step or verify pass). Writes native_ab.md and
record.json; asserts nothing.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from harness import opening, record, tables, timer

EXPERIMENT = "native-ab"
LENGTHS = (64, 512, 1000)
ROOT = Path(__file__).resolve().parents[1]


def sources_of(old: str, into: Path) -> Path:
    """A folder with OLD's C sources: OLD itself, or a commit's specdec/native/*.c, *.h written into `into`."""
    from specdec.native import build

    if Path(old).is_dir():
        return Path(old)
    for path in build.SOURCES + build.HEADERS:
        done = subprocess.run(["git", "-C", str(ROOT), "show", f"{old}:specdec/native/{path.name}"],
                              capture_output=True)
        if done.returncode != 0:
            raise SystemExit(f"{old} has no specdec/native/{path.name}: it predates the native ABI this specdec reads")
        (into / path.name).write_bytes(done.stdout)
    return into


def build_of(folder: Path, into: Path):
    from specdec.native import build

    library = into / "old.so"
    done = subprocess.run([build.compiler(), *build.FLAGS, *(str(folder / p.name) for p in build.SOURCES), "-o",
                           str(library), *build.LIBRARIES], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the other sources do not compile: {done.stderr.strip().splitlines()[-1:]}")
    try:
        return build.checked(library)
    except Exception as exc:  # noqa: BLE001 - a script's message, not a library's
        raise SystemExit(f"the other build is not usable here: {exc}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("old", help="a git commit, or a folder of the native engine's C sources")
    parser.add_argument("--role", choices=("draft", "target"), default="draft")
    parser.add_argument("--rounds", type=int, default=24, help="forwards per build and cache length")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per row")
    parser.add_argument("--rows", type=int, default=1, help="rows per forward")
    parser.add_argument("--verify-rows", type=int, default=9, help="above this many tokens, a prompt's chunk")
    opening.add_common(parser, backend=False)
    args = parser.parse_args()
    from specdec.native import build

    generator = opening.open_bundle(args.bundle, backend="native", threads=args.threads)
    target = generator.target.backend
    model = opening.models(generator)[args.role].model
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"new": build.load_kernels(), "old": build_of(sources_of(args.old, Path(scratch)), Path(scratch))}
    rng, rows = np.random.default_rng(0), []
    for length in (n for n in LENGTHS if n + args.tokens <= model.max_seq_len):
        target.reset(args.rows)
        for slot in range(args.rows):
            target.forward(rng.integers(3, target.vocab_size, (1, length)), np.zeros(1, np.int64), last_only=True,
                           slots=np.array([slot]))
        ids, starts, slots = np.full((args.rows, args.tokens), 7), np.full(args.rows, length), np.arange(args.rows)
        last_only = args.tokens > args.verify_rows

        def call(name):
            def run():
                model.kernels = builds[name]
                model.forward(ids, starts, slots, last_only, generator.target.threads or build_threads())
            return run

        samples = timer.interleave({name: call(name) for name in builds}, args.rounds)
        new, old = timer.summarize(samples["new"]), timer.summarize(samples["old"])
        rows.append([length, new.ms(2), old.ms(2), f"{new.min / old.min:.3f}", f"{new.median / old.median:.3f}"])
    model.kernels = builds["new"]
    run = record.run_record(EXPERIMENT, {"specdec native": {"role": args.role, "old": args.old, "rows": args.rows,
                                                            "tokens": args.tokens}}, args.threads, __file__)
    folder = record.run_dir(EXPERIMENT, run, args.out)
    text = (f"{args.role}, {args.rows} x {args.tokens}-token forwards, ms (min / median of {args.rounds} "
            f"interleaved calls); old = {args.old}\n\n"
            + tables.markdown(["cache length", "new", "old", "new / old (min)", "new / old (median)"], rows))
    tables.write_text(folder / "native_ab.md", text)
    record.write_record(folder, run)
    print(text)


def build_threads() -> int:
    from specdec.runtime.backend import default_threads

    return default_threads()


if __name__ == "__main__":
    main()
