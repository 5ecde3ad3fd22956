"""A kernel change, measured: forwards of one model on two builds of the native engine's C sources in one process,
calls interleaved (which build goes first alternates), so the machine's drift falls on both alike.

    python benchmarks/native_ab.py bundles/smollm2-q41 HEAD~1                 # this tree against a commit's sources
    python benchmarks/native_ab.py bundles/smollm2-q41 /tmp/other --role target --tokens 5 --rows 4
    python benchmarks/native_ab.py bundles/smollm2-q41 HEAD~1 --isa avx2      # both builds for AVX2 only
    python benchmarks/native_ab.py bundles/smollm2-q41 HEAD~1 --busy 1        # beside a process spinning on a core
    python benchmarks/native_ab.py bundles/smollm2-q41 HEAD~1 --activations int8 --role target --tokens 5

OLD: a git commit (its specdec/native/*.c and *.h) or a folder holding the sources. Both builds must export the ABI
this specdec reads (specdec_native.h); older sources are refused. Both are built for one instruction set with one
flag set, so a difference is the code's, never the ISA's: the new build is the one specdec makes (--isa, else
SPECDEC_NATIVE_ISA, else the widest this CPU runs: specdec.native.build.isa()), the old one takes its compiler and
flags. At cache lengths 64 / 512 / 1000 (a random prompt prefilled by the target): forwards of --tokens tokens for
--rows rows of the role (a prompt's chunk, last row scored, where tokens > --verify-rows; else every row scored, as
a step or verify pass). --busy N runs N processes that each spin on a core while both builds are timed (a change to
the thread pool, measured where another process holds a core). Writes native_ab.md and record.json, each naming both
builds' ISA and flags; asserts nothing.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from harness import opening, record, tables, timer
from specdec.native.build import ISAS

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


def build_of(folder: Path, into: Path, flags: tuple):
    """OLD's sources in `folder` compiled with this specdec's compiler and `flags`, loaded and checked: refused where
    they read another weights format (the same bundle's blocks would mean other weights to them)."""
    from specdec.weights_file import FORMAT_VERSION
    from specdec.native import build

    found = re.search(r"#define SPECDEC_FORMAT_VERSION (\d+)", (folder / "specdec_native.h").read_text())
    if found is None or int(found.group(1)) != FORMAT_VERSION:
        raise SystemExit(f"the other sources read native weights of format {found.group(1) if found else '?'}, this "
                         f"specdec writes format {FORMAT_VERSION}: time them on their own bundle with "
                         "benchmarks/tree_ab.py")

    library = into / "old.so"
    done = subprocess.run([build.compiler(), *flags, *(str(folder / p.name) for p in build.SOURCES), "-o",
                           str(library), *build.LIBRARIES], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the other sources do not compile: {done.stderr.strip().splitlines()[-1:]}")
    try:
        return build.checked(library)
    except Exception as exc:  # noqa: BLE001 - a script's message, not a library's
        raise SystemExit(f"the other build is not usable here: {exc}") from None


def opened(args):
    """(the generator, its role's native model, {"new": kernels, "old": kernels}, its settings): the bundle opened on
    the native backend with its kernels built for --isa (specdec's own build), and OLD built with the same compiler
    and flags. The settings name each build under "builds": its sources, instruction set, compiler and flags."""
    from specdec.errors import SpecDecError
    from specdec.native import build

    try:
        with opening.native_env(isa=args.isa):
            generator = opening.open_bundle(args.bundle, backend="native", threads=args.threads,
                                            activations=args.activations)
            isa, flags, cc = build.isa(), build.build_flags(), build.compiler()
            settings = opening.describe(generator)
    except SpecDecError as exc:
        raise SystemExit(str(exc)) from None
    model = opening.models(generator)[args.role].model
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {"new": model.kernels, "old": build_of(sources_of(args.old, Path(scratch)), Path(scratch), flags)}
    old = record.repo_path(args.old) if Path(args.old).is_dir() else args.old  # a record holds no machine's paths
    builds = {side: {"sources": sources, "isa": isa, "compiler": Path(cc).name, "flags": list(flags)}
              for side, sources in (("new", "this tree"), ("old", old))}
    return generator, model, kernels, settings | {"builds": builds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("old", help="a git commit, or a folder of the native engine's C sources")
    parser.add_argument("--role", choices=("draft", "target"), default="draft")
    parser.add_argument("--rounds", type=int, default=24, help="forwards per build and cache length")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per row")
    parser.add_argument("--rows", type=int, default=1, help="rows per forward")
    parser.add_argument("--verify-rows", type=int, default=9, help="above this many tokens, a prompt's chunk")
    parser.add_argument("--isa", choices=ISAS, default=None,
                        help="the instruction set both builds are made for (default: as SPECDEC_NATIVE_ISA says, the "
                             "widest this CPU runs unless set)")
    parser.add_argument("--activations", choices=("fp32", "int8"), default=None,
                        help="the target's activations (default: the bundle's)")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on a core while the builds are timed")
    opening.add_common(parser, backend=False)
    args = parser.parse_args()
    if args.busy < 0:
        raise SystemExit(f"--busy {args.busy}: pass 0 or more processes")
    generator, model, builds, settings = opened(args)
    old = settings["builds"]["old"]["sources"]
    run = record.run_record(EXPERIMENT, {"specdec native": settings | {"role": args.role, "old": old, "rows": args.rows,
                                                                       "tokens": args.tokens}}, args.threads, __file__,
                            busy=args.busy)
    target = generator.target.backend
    model.threads = generator.target.threads or build_threads()
    rng, rows = np.random.default_rng(0), []
    for length in (n for n in LENGTHS if n + args.tokens <= model.max_seq_len):
        target.reset(args.rows)
        for slot in range(args.rows):
            target.forward(rng.integers(3, target.vocab_size, (1, length)), np.zeros(1, np.int64), last_only=True,
                           slots=np.array([slot]))
        ids, starts, slots = np.full((args.rows, args.tokens), 7), np.full(args.rows, length), np.arange(args.rows)
        last_only = args.tokens > args.verify_rows

        def call(name):
            def forward():
                model.kernels = builds[name]
                model.forward(ids, starts, slots, last_only)
            return forward

        with timer.busy(args.busy):
            samples = timer.interleave({name: call(name) for name in builds}, args.rounds)
        rows.append([length, *timer.compared(timer.summarize(samples["new"]), timer.summarize(samples["old"]))])
    model.kernels = builds["new"]
    described = "\n".join(f"- {side}: {b['sources']}; ISA {b['isa']}; {b['compiler']} {' '.join(b['flags'])}"
                          for side, b in settings["builds"].items())
    beside = f", beside {args.busy} process{'es' if args.busy > 1 else ''} spinning on a core each" if args.busy else ""
    text = (f"{args.role}, {args.rows} x {args.tokens}-token forwards, ms (min / median of {args.rounds} "
            f"interleaved calls{beside}); old = {old}\n\n{described}\n\n"
            + tables.markdown(["cache length", "new", "old", "new / old (min)", "new / old (median)"], rows))
    record.finish(run, args.out, {"native_ab.md": text}, shown=text)


def build_threads() -> int:
    from specdec.runtime.backend import default_threads

    return default_threads()


if __name__ == "__main__":
    main()
