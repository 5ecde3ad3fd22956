"""The suite against peers: specdec and onnxruntime-genai request by request. Every (system, mode) takes its turn on
the same prompt before the next prompt starts, so a drift of the machine (a neighbour, the memory bus) falls on all
of them alike. The only entry point for ratios between systems.

    benchmarks/peers/setup.sh                                 # once: the peer's venv and models, tuned as its docs say
    python benchmarks/lockstep.py bundles/smollm2-q41 --backends onnxruntime,native --modes target-only,auto
    python benchmarks/lockstep.py BUNDLE --per-class 2 --modes target-only,auto --peer-modes none   # specdec only

specdec runs in this process (specdec.load, the runtime's own options), one system per --backends value.
onnxruntime-genai runs in a worker process of its own virtual environment (benchmarks/.peers/ortgenai: its model
builder's fp32 graph of the same weights, intra_op_num_threads = cores, inter_op_num_threads = 1, as its docs tell CPU
users to tune it), which waits on a pipe while specdec runs. Per prompt the order of the (system, mode) pairs is
rotated by one, with a short pause between requests so no system's spinning workers overlap the next. Greedy; EOS
ends a request.

Writes `specdec bench`'s tables with every system in one (summary.md; summary.csv, which the docs' performance page
reads; requests.csv), pairs.md (per-prompt ratios of time per output token between pairs of modes, whose spread
shows how much of a ratio is the prompt and how much the machine) and record.json. No assertions (not a test).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from harness import opening, record, tables, timer

HERE = Path(__file__).resolve().parent
EXPERIMENT = "lockstep"
PEER_SYSTEM = "onnxruntime-genai"
PEER_MODES = ("target-only", "n-gram")


class Peer:
    """The coordinator's end of the peer worker's pipe."""

    def __init__(self, python: Path, models: Path, gamma: int):
        import subprocess

        worker = HERE / "peers" / "ortgenai_peer.py"  # runs in the peer's venv, without specdec
        self.proc = subprocess.Popen([str(python), str(worker), "--worker", str(models), str(gamma)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        self.notes = hello["notes"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {PEER_SYSTEM} worker exited (code {self.proc.wait()}); see its error above")
        return json.loads(line)

    def run(self, mode: str, ids: list, new_tokens: int, prompt=None, repeat: int = 0) -> dict:
        """One request; -> its record in the table's columns (status "failed" with the error where it failed)."""
        ask = {"mode": mode, "ids": ids, "new_tokens": new_tokens, "repeat": repeat,
               "prompt": {"id": prompt.id, "class": prompt.cls} if prompt is not None else {"id": "-", "class": "-"}}
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


NATIVE_SYSTEM = "specdec native"  # specdec with --backends native: the target on specdec's own kernels
SYSTEMS = {"onnxruntime": "specdec", "native": NATIVE_SYSTEM}  # --backends value -> system name in the tables
PAIRS = (  # (numerator system, mode prefix), (denominator ...): ratio = TPOT of the first / TPOT of the second
    (("specdec", "target-only"), (PEER_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "target-only"), (PEER_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "target-only"), ("specdec", "target-only")),
    ((NATIVE_SYSTEM, "target-only"), (PEER_SYSTEM, "n-gram")),
    ((NATIVE_SYSTEM, "auto"), (PEER_SYSTEM, "n-gram")),
    (("specdec", "auto"), ("specdec", "target-only")),
    (("specdec", "model"), ("specdec", "target-only")),
    (("specdec", "auto"), (PEER_SYSTEM, "n-gram")),
    ((PEER_SYSTEM, "n-gram"), (PEER_SYSTEM, "target-only")),
)


def pair_table(records: list) -> str:
    """Per-prompt TPOT ratios of PAIRS: median, 10th and 90th percentile over prompts, and the token-weighted ratio
    (the suite's measure: total decode time over total tokens, of each side)."""
    import numpy as np

    def side(system: str, prefix: str) -> dict:
        rows = [r for r in records if r.get("status") == "ok" and r["system"] == system
                and r["mode"].startswith(prefix) and r["new_tokens"] > 1]
        return {r["prompt_id"]: r for r in rows}

    lines = ["| ratio of TPOT | prompts | per prompt: median | p10 | p90 | token-weighted |", "|---|---|---|---|---|---|"]
    for (a_sys, a_mode), (b_sys, b_mode) in PAIRS:
        a, b = side(a_sys, a_mode), side(b_sys, b_mode)
        common = sorted(set(a) & set(b))
        if not common:
            continue
        ratios = np.array([a[p]["tpot_s"] / b[p]["tpot_s"] for p in common])

        def weighted(rows: dict) -> float:
            return sum(rows[p]["e2e_s"] - rows[p]["ttft_s"] for p in common) / sum(rows[p]["new_tokens"] - 1
                                                                                   for p in common)
        name = f"{a_sys} {a_mode} / {b_sys} {b_mode}"
        lines.append(f"| {name} | {len(common)} | {np.median(ratios):.3f} | {np.percentile(ratios, 10):.3f} | "
                     f"{np.percentile(ratios, 90):.3f} | {weighted(a) / weighted(b):.3f} |")
    return "\n".join(lines) + "\n\n(below 1: the first is faster)\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--prompts", default=str(HERE / "prompts"))
    parser.add_argument("--per-class", type=int, default=0, help="prompts per class (0: all)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=None, help="specdec's γ (default: the bundle's)")
    parser.add_argument("--modes", default="target-only,auto,model", help="specdec drafters (target-only = none)")
    parser.add_argument("--backends", default="onnxruntime",
                        help="specdec's backends, each a system of its own: onnxruntime (system specdec), native "
                             f"(system {NATIVE_SYSTEM!r}); comma-separated")
    parser.add_argument("--peer-gamma", type=int, default=4, help="the peer's n-gram max_draft_tokens")
    parser.add_argument("--peer-modes", default=",".join(PEER_MODES), help="'none' to run specdec alone")
    parser.add_argument("--peers-dir", default=str(HERE / ".peers"), help="venvs and models from peers/setup.sh")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between requests")
    parser.add_argument("--out", default=None,
                        help="output folder (default: benchmarks/results/lockstep/<date>-<commit>/)")
    return parser.parse_args()


def open_peer(args) -> tuple:
    """(the peer's worker or None, its modes)."""
    peer_modes = [] if args.peer_modes == "none" else [m.strip() for m in args.peer_modes.split(",") if m.strip()]
    unknown = [m for m in peer_modes if m not in PEER_MODES]
    if unknown:
        raise SystemExit(f"unknown peer mode {unknown[0]!r}; choose from {', '.join(PEER_MODES)} or none")
    if not peer_modes:
        return None, []
    python = Path(args.peers_dir) / "ortgenai" / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no onnxruntime-genai venv at {python.parent.parent}; run benchmarks/peers/setup.sh "
                         "first, or pass --peer-modes none")
    return Peer(python, Path(args.peers_dir) / "models", args.peer_gamma), peer_modes


def specdec_modes(args, gamma: int) -> list:
    from specdec.bench.config import BASELINE, Mode

    return [Mode(BASELINE, "none") if m == BASELINE else Mode(f"{m} γ={gamma}", m, gamma)
            for m in (part.strip() for part in args.modes.split(",")) if m]


def run_turns(generators: dict, peer, turns: list, prompts: list, ids: dict, args) -> list:
    """Warm-up (not recorded), then repeats × prompts × turns, the turns rotated by one per prompt."""
    from tqdm import tqdm

    from specdec.bench.run import record_from_result
    from specdec.runtime.config import GenerationConfig

    def one(system, mode, prompt, repeat: int, new_tokens: int) -> dict:
        if system not in generators:
            return peer.run(mode, ids[prompt.id], new_tokens, prompt, repeat)
        config = GenerationConfig(max_new_tokens=new_tokens, drafter=mode.drafter, gamma=mode.gamma)
        began = time.perf_counter()
        result = generators[system].generate(ids[prompt.id], config)
        elapsed = time.perf_counter() - began
        return record_from_result(result, elapsed, mode, mode.gamma or 0, prompt, repeat, 0) | {"system": system}

    for system, mode in turns:
        one(system, mode, prompts[0], -1, 8)
    records = []
    with tqdm(total=args.repeats * len(prompts) * len(turns), desc="lockstep", unit="req") as bar:
        for repeat in range(args.repeats):
            for index, prompt in enumerate(prompts):
                for system, mode in timer.rotated(turns, repeat * len(prompts) + index):
                    time.sleep(args.pause)
                    records.append(one(system, mode, prompt, repeat, args.new_tokens))
                    bar.update(1)
    return records


def main() -> int:
    args = parse_args()
    from specdec.bench.prompts import read_prompts, select_prompts
    from specdec.bench.report import write_outputs
    from specdec.bench.run import describe_pair, prompt_ids

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in SYSTEMS for b in backends):
        raise SystemExit(f"unknown backend in {args.backends!r}; choose from {', '.join(SYSTEMS)}")
    peer, peer_modes = open_peer(args)
    with contextlib.ExitStack() as stack:
        generators = {SYSTEMS[b]: stack.enter_context(opening.open_bundle(args.bundle, b)) for b in backends}
        generator = next(iter(generators.values()))
        modes = specdec_modes(args, args.gamma or generator.manifest.defaults.gamma)
        every = read_prompts(args.prompts)
        ids = prompt_ids(generator, every)
        room = generator.manifest.target.max_seq_len - args.new_tokens - 1
        prompts = select_prompts(every, {k: len(v) for k, v in ids.items()}, args.per_class, room)
        turns = [(s, m) for s in generators for m in modes] + [(PEER_SYSTEM, m) for m in peer_modes]
        settings = {system: opening.describe(g) for system, g in generators.items()}
        if peer is not None:
            settings[PEER_SYSTEM] = {"modes": peer.notes, "max_draft_tokens": args.peer_gamma}
        run = record.run_record(EXPERIMENT, settings, None, __file__, None, prompts=len(prompts),
                                new_tokens=args.new_tokens, repeats=args.repeats,
                                order="per prompt, every (system, mode) in turn, rotated by one per prompt")
        records = run_turns(generators, peer, turns, prompts, ids, args)
        pair = describe_pair(generator.manifest)
    if peer is not None:
        peer.close()
    folder = record.run_dir(EXPERIMENT, run, args.out)
    info = dict(bundle=args.bundle, prompts=len(prompts), classes=sorted({p.cls for p in prompts}),
                modes=[f"{s}: {m if isinstance(m, str) else m.name}" for s, m in turns], repeats=args.repeats,
                max_new_tokens=args.new_tokens, temperature=0.0, warmup=1, seed=0, command=run["command"],
                models=pair, date=run["started"])
    paths = write_outputs(records, folder, info, plots=False)
    paths["run"].unlink()  # record.json replaces it
    pairs = pair_table(records)
    tables.write_text(folder / "pairs.md", pairs)
    record.write_record(folder, run, models=pair)
    print(paths["markdown"].read_text(encoding="utf-8"))
    print(pairs)
    print(f"written: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
