"""onnxruntime thread schemes for a draft and a target session sharing few cores: the evidence for the session options
the runtime sets (specdec.runtime.backend.session_options).

    python benchmarks/thread_schemes.py bundles/smollm2-q41 --rounds 3

Each scheme runs in its own process (a global thread pool is per process), which opens the bundle through
specdec.load on the onnxruntime backend with the scheme's session options; the processes take turns round by round,
the order rotated per round.
In each: plain decoding (16 target steps, T = 1) and speculative-shaped rounds (4 draft steps, then a T = 5 target
verify), ms per target step / per round / per draft step. Schemes:
  nospin    per-session pools, session.intra_op.allow_spinning = 0
  spin      per-session pools, spinning on (onnxruntime's default)
  spinstop  per-session pools, spinning on, session.force_spinning_stop = 1 (spin only while a Run lasts)
  global    one global pool (set_global_thread_pool_sizes(cores, 1), use_per_session_threads = False)
Writes threads.md (min / median over the rounds) and record.json; no assertions (not a test).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from harness import opening, record, tables, timer

EXPERIMENT = "threads"

SCHEMES = ("nospin", "spin", "spinstop", "global")


def options_for(scheme: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = len(os.sched_getaffinity(0))
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0" if scheme == "nospin" else "1")
    if scheme == "spinstop":
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if scheme == "global":
        options.use_per_session_threads = False
    return options


def child(scheme: str, bundle: Path, cache_len: int = 64) -> dict:
    """Time one scheme in this process. -> {"plain": ms per step, "round": ms per round, "draft": ms per step}"""
    import numpy as np
    import onnxruntime as ort

    from specdec.runtime import ort_backend

    if scheme == "global":
        ort.capi._pybind_state.set_global_thread_pool_sizes(len(os.sched_getaffinity(0)), 1)
    # the scheme's options for every session this child process opens (where OrtBackend looks the function up)
    ort_backend.session_options = lambda threads=None: options_for(scheme)
    generator = opening.open_bundle(bundle, "onnxruntime")
    models = opening.models(generator)
    if "draft" not in models:
        raise SystemExit(f"{bundle} has no draft model: the rounds need one")
    target, draft = models["target"], models["draft"]
    for backend in (target, draft):
        backend.reset(1)
        backend.forward(np.full((1, cache_len), 5, np.int64), np.array([0]), last_only=True)
    one, five = np.array([[7]], np.int64), np.full((1, 5), 7, np.int64)

    def steps(model, count: int) -> None:
        for step in range(count):
            model.forward(one, np.array([cache_len + step]))

    def speculative_round() -> float:  # -> its 4 draft steps' seconds
        _, drafting = timer.timed(lambda: steps(draft, 4))
        target.forward(five, np.array([cache_len]))
        return drafting

    _, plain = timer.timed(lambda: steps(target, 16))
    drafts, rounds = timer.timed(lambda: [speculative_round() for _ in range(8)])
    generator.close()
    return {"plain": plain / 16 * 1e3, "round": rounds / 8 * 1e3, "draft": sum(drafts) / 32 * 1e3}


def table(samples: dict, bundle: Path, rounds: int) -> str:
    rows = [[scheme] + [timer.summarize([r[k] / 1e3 for r in runs]).ms(1) for k in ("plain", "round", "draft")]
            for scheme, runs in samples.items()]
    header = ["scheme", "plain decode ms/step", "draft 4 + verify T=5 ms/round", "draft ms/step"]
    return (f"Thread schemes on {bundle.name} ({os.cpu_count()} CPUs; {rounds} interleaved processes per scheme; "
            "ms, min / median)\n\n" + tables.markdown(header, rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--cache-len", type=int, default=64)
    opening.add_out(parser)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.bundle, args.cache_len)))
        return 0
    schemes = [s for s in args.schemes.split(",") if s]
    if not schemes or any(s not in SCHEMES for s in schemes):
        raise SystemExit(f"unknown scheme in {args.schemes!r}; choose from {', '.join(SCHEMES)}")
    settings = {scheme: {"session options": scheme, "intra_op_num_threads": len(os.sched_getaffinity(0)),
                         "inter_op_num_threads": 1} for scheme in schemes}
    run = record.run_record(EXPERIMENT, settings, len(os.sched_getaffinity(0)), __file__, argv, rounds=args.rounds)
    samples = {scheme: [] for scheme in schemes}
    for index in range(args.rounds):
        for scheme in timer.rotated(schemes, index):
            done = subprocess.run([sys.executable, __file__, str(args.bundle), "--child", scheme, "--cache-len",
                                   str(args.cache_len)], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"scheme {scheme} failed:\n{done.stderr[-2000:]}")
            samples[scheme].append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = table(samples, args.bundle, args.rounds)
    record.finish(run, args.out, {"threads.md": text}, shown=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
