"""Two checkouts of specdec, each decoding its own bundle, timed in alternating processes: a change native_ab.py cannot
compare in one process, such as a new weights format (an older checkout reads only its own bundles, this one only
the new format's).

    git worktree add /tmp/old HEAD~1    # and export the bundle there too, with that checkout's specdec-export
    python benchmarks/tree_ab.py bundles/smollm2-q4km /tmp/old /tmp/old-bundles/smollm2-q4km --rounds 6
    python benchmarks/tree_ab.py bundles/smollm2-q4km /tmp/old /tmp/old-bundles/smollm2-q4km --isa avx2

Each round starts one process per side (which side goes first alternates), with that checkout first on PYTHONPATH:
it opens its bundle on the native backend (built for --isa where given, else as SPECDEC_NATIVE_ISA says, else for the
widest set that checkout knows this CPU runs: the table names each side's), prefills a random --length-token prompt,
then times --steps one-token steps of the target, each a forward through the backend as generation calls it. A
side's samples are every step of every round.
Writes tree_ab.md and record.json; asserts nothing. The two bundles should hold the same model: check that their
logits agree (`specdec.runtime.load(...).target.forward`) before reading a time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from harness import record, tables, timer
from specdec.native.build import ISA_ENV, ISAS

EXPERIMENT = "tree-ab"
ROOT = Path(__file__).resolve().parents[1]
# a side's process: only what every checkout of specdec has (runtime.load, a backend's reset and forward)
CHILD = """
import json, sys, time
import numpy as np
from specdec.native.build import isa
from specdec.runtime import load
bundle, length, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target = load(bundle, backend="native").target
rng = np.random.default_rng(0)
target.reset(1)
target.forward(rng.integers(3, target.vocab_size, (1, length)), np.array([0]), slots=np.array([0]))
seconds = []
for step in range(steps):
    ids = rng.integers(3, target.vocab_size, (1, 1))
    started = time.perf_counter()
    target.forward(ids, np.array([length + step]), slots=np.array([0]))
    seconds.append(time.perf_counter() - started)
print(json.dumps({"isa": str(isa()), "seconds": seconds}))
"""


def side(tree: Path, bundle: Path, length: int, steps: int, isa: str | None) -> dict:
    """One process of one side: {"isa", "seconds"}; SystemExit with its last error line where it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if isa:
        env[ISA_ENV] = isa
    done = subprocess.run([sys.executable, "-c", CHILD, str(bundle), str(length), str(steps)], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        last = " ".join(done.stderr.strip().splitlines()[-2:]) or "no message"
        raise SystemExit(f"{tree} could not decode {bundle}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit_of(tree: Path) -> str:
    """The short commit `tree` has checked out ("-dirty" where its code differs from it), or "none" outside git."""
    done = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=7",
                           "--exclude", "*"], capture_output=True, text=True)
    return done.stdout.strip() or "none" if done.returncode == 0 else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path, help="the bundle this checkout decodes")
    parser.add_argument("old_tree", type=Path, help="the other checkout's root (a git worktree, say)")
    parser.add_argument("old_bundle", type=Path, help="the bundle the other checkout decodes")
    parser.add_argument("--rounds", type=int, default=6, help="processes per side")
    parser.add_argument("--steps", type=int, default=300, help="one-token steps timed per process")
    parser.add_argument("--length", type=int, default=64, help="the prompt's tokens before the steps")
    parser.add_argument("--isa", choices=ISAS, default=None, help="the instruction set both sides build for")
    parser.add_argument("--out", type=Path, default=None, help="the run's folder (default: benchmarks/results/...)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.length < 1:
        raise SystemExit(f"--rounds {args.rounds}, --steps {args.steps}, --length {args.length}: pass 1 or more")
    for path in (args.bundle, args.old_bundle, args.old_tree / "specdec"):
        if not path.exists():
            raise SystemExit(f"{path} does not exist")
    sides = {"new": (ROOT, args.bundle.resolve()), "old": (args.old_tree.resolve(), args.old_bundle.resolve())}
    trees = {"new": "this tree", "old": record.repo_path(args.old_tree.resolve())}
    run = record.run_record(EXPERIMENT, {}, None, __file__)  # started now; its settings once each side has said its ISA
    samples, isas = {name: [] for name in sides}, {}
    for index in range(args.rounds):
        for name in timer.rotated(list(sides), index):
            got = side(*sides[name], args.length, args.steps, args.isa)
            samples[name] += got["seconds"]
            isas[name] = got["isa"]
    settings = {name: {"tree": trees[name], "commit": commit_of(tree),
                       "bundle": record.repo_path(bundle), "isa": isas[name]} for name, (tree, bundle) in sides.items()}
    run["settings"] = {"specdec native": {"sides": settings, "length": args.length, "steps": args.steps,
                                          "rounds": args.rounds}}
    new, old = timer.summarize(samples["new"]), timer.summarize(samples["old"])
    described = "\n".join(f"- {name}: {s['tree']} (commit {s['commit']}), {s['bundle']}; ISA {s['isa']}"
                          for name, s in settings.items())
    text = (f"one-token steps of the target at cache length {args.length}+, ms (min / median of {args.rounds} "
            f"alternating processes x {args.steps} steps)\n\n{described}\n\n"
            + tables.markdown(["new", "old", "new / old (min)", "new / old (median)"], [timer.compared(new, old)]))
    record.finish(run, args.out, {"tree_ab.md": text}, shown=text)


if __name__ == "__main__":
    main()
