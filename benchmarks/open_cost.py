"""What opening a bundle costs on each backend: `specdec.load` in a fresh process (hashes checked, as a user's call
does), its wall time, the process's peak RSS while opening, and its RSS while generating afterwards. Each round
opens every backend once, in its own process, the order rotated per round.

    python benchmarks/open_cost.py bundles/smollm2-q41 --rounds 5
    python benchmarks/open_cost.py bundles/smollm2-q41 --backends onnxruntime,native --no-verify

Writes open_cost.md and record.json; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness import opening, record, tables, timer

EXPERIMENT = "open-cost"
CHILD = r"""
import json, resource, sys, time
started = time.perf_counter()
import specdec
imported = time.perf_counter()
bundle, backend, verify, threads = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]) or None
generator = specdec.load(bundle, backend=backend, verify=verify, threads=threads)
opened = time.perf_counter()
peak_open = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
config = specdec.GenerationConfig(max_new_tokens=32, drafter="none", eos_token_ids=())
generator.generate("The history of the lighthouse", config)
pages = int(open("/proc/self/statm").read().split()[1])
import os
print(json.dumps({"import_s": imported - started, "open_s": opened - imported, "peak_open": peak_open,
                  "running": pages * os.sysconf("SC_PAGE_SIZE"), "backend": generator.backend,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def open_once(bundle: Path, backend: str, verify: bool, threads: int | None) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(bundle), backend, "1" if verify else "0",
                           str(threads or 0)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"opening on {backend} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--backends", default="onnxruntime,native")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 checks (load(verify=False))")
    opening.add_common(parser, backend=False)
    args = parser.parse_args()
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    runs = {name: [] for name in backends}
    open_once(args.bundle, backends[0], not args.no_verify, args.threads)  # warm: the page cache, the kernels' build
    for index in range(args.rounds):
        for name in timer.rotated(backends, index):
            runs[name].append(open_once(args.bundle, name, not args.no_verify, args.threads))
    rows = []
    for name, got in runs.items():
        seconds = timer.summarize([run["open_s"] for run in got])
        mib = lambda key: max(run[key] for run in got) / 2**20  # noqa: E731
        rows.append([f"{name} ({got[0]['backend']})", f"{seconds.min:.2f} / {seconds.median:.2f}",
                     f"{timer.summarize([run['import_s'] for run in got]).median:.2f}", f"{mib('peak_open'):.0f}",
                     f"{mib('running'):.0f}", f"{mib('peak'):.0f}"])
    settings = {f"specdec {name}": {"verify": not args.no_verify, "threads": args.threads} for name in backends}
    run = record.run_record(EXPERIMENT, settings, args.threads, __file__, rounds=args.rounds)
    text = (f"specdec.load of {args.bundle.name} in a fresh process ({args.rounds} rounds, rotated; sha256 "
            f"{'skipped' if args.no_verify else 'checked'})\n\n"
            + tables.markdown(["backend", "load s (min / median)", "import s (median)", "peak RSS opening MiB",
                               "RSS generating MiB", "peak RSS MiB"], rows))
    record.finish(run, args.out, {"open_cost.md": text}, shown=text, results=runs)


if __name__ == "__main__":
    main()
