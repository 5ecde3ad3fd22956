"""specdec against onnxruntime-genai request by request: every system takes its turn on the same prompt before the
next prompt starts, so a drift of the machine (a neighbour, the memory bus) falls on all of them alike.

    python benchmarks/lockstep.py bundles/smollm2-q41 --out benchmarks/results/lockstep   # after peers/setup.sh
    python benchmarks/lockstep.py BUNDLE --per-class 2 --modes target-only,auto --peer-modes none   # specdec only
    python benchmarks/lockstep.py BUNDLE --backends onnxruntime,native ...   # specdec's native backend as a system too

`benchmarks/suite.sh` runs specdec's modes, then the peer's, then transformers, each for the whole suite: minutes
apart, so a ratio between systems carries whatever the machine did in between. Here specdec runs in this process
(specdec.load, the runtime's own options) and onnxruntime-genai in a worker process of its own virtual environment
(benchmarks/.peers/ortgenai, models and settings from setup.sh: intra_op_num_threads = cores), which waits on a
pipe while specdec runs. Per prompt the order of the (system, mode) pairs is rotated, with a short pause between
requests so no system's spinning workers overlap the next. Greedy; EOS ends a request, as in the suite.

Writes `specdec bench`'s outputs (summary.md, summary.csv, requests.csv, ...) with both systems in one table, and
pairs.md: per-prompt ratios of time per output token (TPOT) between chosen pairs of modes, whose spread shows how
much of a ratio is the prompt and how much the machine. No assertions (not a test).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))  # peer_common and ortgenai_peer: stdlib at import, as the peer's venv needs
PEER_SYSTEM = "onnxruntime-genai"
PEER_MODES = ("target-only", "n-gram")


def peer_worker(models: str, gamma: int) -> None:
    """Runs in the peer's venv: reads {"mode", "ids", "new_tokens"} lines, answers {"tokens", "ttft", "e2e", ...}."""
    import onnxruntime_genai as og
    from ortgenai_peer import fp32_modes

    _, plain, ngram = fp32_modes(og, Path(models), gamma)  # the suite's own peer modes and settings notes
    runs = {"target-only": plain.run, "n-gram": ngram.run}
    notes = {"target-only": plain.note, "n-gram": ngram.note}
    runs["target-only"]([1, 2, 3], 4)  # warm-up
    print(json.dumps({"ready": True, "notes": notes}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            tokens, ttft, e2e, extra = runs[ask["mode"]](ask["ids"], ask["new_tokens"])
            print(json.dumps({"tokens": [int(t) for t in tokens], "ttft": ttft, "e2e": e2e, "extra": extra}), flush=True)
        except Exception as exc:  # reported to the coordinator, which records the request as failed
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


class Peer:
    """The coordinator's end of the peer worker's pipe."""

    def __init__(self, python: Path, models: Path, gamma: int):
        import subprocess

        self.proc = subprocess.Popen([str(python), __file__, "--peer-worker", str(models), str(gamma)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        self.notes = hello["notes"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {PEER_SYSTEM} worker exited (code {self.proc.wait()}); see its error above")
        return json.loads(line)

    def run(self, mode: str, ids: list, new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"mode": mode, "ids": ids, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def peer_record(answer: dict, mode: str, note: str, gamma: int, prompt, repeat: int, ids: list) -> dict:
    from peer_common import PeerMode, record

    peer_mode = PeerMode(mode, "none" if mode == "target-only" else "prompt_lookup", 0 if mode == "target-only"
                         else gamma, note, None)
    if "error" in answer:
        return dict(system=PEER_SYSTEM, mode=mode, drafter=peer_mode.drafter, gamma=peer_mode.gamma,
                    note=f"{note}; failed: {answer['error']}"[:400], status="failed", prompt_id=prompt.id,
                    cls=prompt.cls, repeat=repeat)
    result = (answer["tokens"], answer["ttft"], answer["e2e"], answer["extra"])
    return record(PEER_SYSTEM, peer_mode, {"id": prompt.id, "class": prompt.cls}, repeat, ids, result)


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
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer-worker":
        peer_worker(sys.argv[2], int(sys.argv[3]))
        return 0
    args = parse_args()
    from tqdm import tqdm

    from specdec.bench.config import BASELINE, Mode
    from specdec.bench.prompts import read_prompts, select_prompts
    from specdec.bench.report import write_outputs
    from specdec.bench.run import describe_pair, prompt_ids, record_from_result, rotated
    from specdec.runtime import load
    from specdec.runtime.config import GenerationConfig

    peer_modes = [] if args.peer_modes == "none" else [m.strip() for m in args.peer_modes.split(",") if m.strip()]
    unknown = [m for m in peer_modes if m not in PEER_MODES]
    if unknown:
        raise SystemExit(f"unknown peer mode {unknown[0]!r}; choose from {', '.join(PEER_MODES)} or none")
    peer = None
    if peer_modes:
        python = Path(args.peers_dir) / "ortgenai" / "bin" / "python"
        if not python.is_file():
            raise SystemExit(f"no onnxruntime-genai venv at {python.parent.parent}; run benchmarks/peers/setup.sh "
                             "first, or pass --peer-modes none")
        peer = Peer(python, Path(args.peers_dir) / "models", args.peer_gamma)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in SYSTEMS for b in backends):
        raise SystemExit(f"unknown backend in {args.backends!r}; choose from {', '.join(SYSTEMS)}")
    generators = {SYSTEMS[b]: load(args.bundle, backend=b) for b in backends}
    with contextlib.ExitStack() as stack:
        for opened in generators.values():
            stack.enter_context(opened)
        generator = next(iter(generators.values()))
        gamma = args.gamma or generator.manifest.defaults.gamma
        modes = [Mode(BASELINE, "none") if m.strip() == BASELINE else Mode(f"{m.strip()} γ={gamma}", m.strip(), gamma)
                 for m in args.modes.split(",") if m.strip()]
        every = read_prompts(args.prompts)
        room = generator.manifest.target.max_seq_len - args.new_tokens - 1
        ids = prompt_ids(generator, every)
        prompts = select_prompts(every, {k: len(v) for k, v in ids.items()}, args.per_class, room)
        turns = [(s, m) for s in generators for m in modes] + [(PEER_SYSTEM, m) for m in peer_modes]
        for system, mode in turns:  # warm-up, not recorded
            if system in generators:
                generators[system].generate(ids[prompts[0].id], GenerationConfig(max_new_tokens=8, drafter=mode.drafter,
                                                                        gamma=mode.gamma))
            else:
                peer.run(mode, ids[prompts[0].id], 8)
        records, started = [], time.strftime("%Y-%m-%d %H:%M")
        total = args.repeats * len(prompts) * len(turns)
        with tqdm(total=total, desc="lockstep", unit="req") as bar:
            for repeat in range(args.repeats):
                for index, prompt in enumerate(prompts):
                    for system, mode in rotated(turns, repeat * len(prompts) + index):
                        time.sleep(args.pause)
                        if system in generators:
                            config = GenerationConfig(max_new_tokens=args.new_tokens, drafter=mode.drafter,
                                                      gamma=mode.gamma)
                            began = time.perf_counter()
                            result = generators[system].generate(ids[prompt.id], config)
                            elapsed = time.perf_counter() - began
                            records.append(record_from_result(result, elapsed, mode, mode.gamma or 0, prompt,
                                                              repeat, 0) | {"system": system})
                        else:
                            answer = peer.run(mode, ids[prompt.id], args.new_tokens)
                            records.append(peer_record(answer, mode, peer.notes[mode], args.peer_gamma, prompt,
                                                       repeat, ids[prompt.id]))
                        bar.update(1)
        pair = describe_pair(generator.manifest)
    if peer is not None:
        peer.close()
    command = " ".join(["python", "benchmarks/lockstep.py", *sys.argv[1:]])
    info = dict(bundle=args.bundle, prompts=len(prompts), classes=sorted({p.cls for p in prompts}),
                modes=[f"{s}: {m if isinstance(m, str) else m.name}" for s, m in turns], repeats=args.repeats,
                max_new_tokens=args.new_tokens, temperature=0.0, warmup=1, seed=0, command=command, models=pair,
                order="per prompt, every (system, mode) in turn, the order rotated by one per prompt",
                started=started, finished=time.strftime("%Y-%m-%d %H:%M"))
    paths = write_outputs(records, args.out, info, plots=False)
    pairs = pair_table(records)
    (Path(args.out) / "pairs.md").write_text(pairs, encoding="utf-8")
    print(paths["markdown"].read_text(encoding="utf-8"))
    print(pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
