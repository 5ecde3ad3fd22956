"""Plain decoding beside other work: ms per token (after the first) of each system idle and beside N busy processes
(each spins on one core), as the slowdown against idle, measured in one run. Systems: specdec on each backend, and
llama.cpp on the same model's GGUF where benchmarks/peers/setup_llamacpp.sh built it (threads = cores, its documented
first setting).

    python benchmarks/contention.py bundles/smollm2-q41 --busy 0,1,3 --tokens 48 --rounds 3
    python benchmarks/contention.py bundles/smollm2-q41 --backends native --busy 0,3 --no-llamacpp

Levels run in the order given, then idle again (drift shows as two idle figures); within a level every system takes
its turn each round, the order rotated. Busy processes are started for a level and killed after it. Writes
contention.md and record.json; asserts nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from harness import opening, record, tables, timer

EXPERIMENT = "contention"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def specdec_system(bundle: Path, backend: str, threads: int | None, tokens: int):
    import specdec

    generator = opening.open_bundle(bundle, backend=backend, threads=threads)
    config = specdec.GenerationConfig(max_new_tokens=tokens, drafter="none", eos_token_ids=())

    def decode() -> float:
        stats = generator.generate(PROMPT, config).stats
        return (stats.total_s - stats.first_token_s) / max(1, stats.emitted - 1)

    return decode, opening.describe(generator)


def llamacpp_system(stack: contextlib.ExitStack, tokens: int, threads: int):
    """(llama.cpp's plain decoding of `tokens` tokens: seconds per token after the first, by its server's own timings;
    its settings) on the default model's GGUF, or None where benchmarks/peers/setup_llamacpp.sh did not build it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers import llamacpp_peer as peer

    if not peer.built():
        return None
    settings = peer.ServerSettings(peer.default_gguf(), peer.Plain(), threads=threads)
    server = stack.enter_context(peer.LlamaServer(settings, max_s=3600.0))
    server.complete(PROMPT, 8)
    return (lambda: server.complete(PROMPT, tokens).tpot_s), settings.describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--backends", default="native,onnxruntime")
    parser.add_argument("--busy", default="0,1,3", help="busy processes per level")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-llamacpp", action="store_true")
    opening.add_common(parser, backend=False)
    args = parser.parse_args()
    systems, settings = {}, {}
    for name in (n.strip() for n in args.backends.split(",") if n.strip()):
        systems[f"specdec {name}"], settings[f"specdec {name}"] = specdec_system(args.bundle, name, args.threads,
                                                                                 args.tokens)
    with contextlib.ExitStack() as stack:
        threads = args.threads or len(os.sched_getaffinity(0))  # llama.cpp's first tuning rule: threads = cores
        peer = None if args.no_llamacpp else llamacpp_system(stack, args.tokens, threads)
        if peer is not None:
            systems["llama.cpp"], settings["llama.cpp"] = peer
        levels = [int(n) for n in args.busy.split(",")]
        results = {}
        for index, level in enumerate(levels + [0]):
            with timer.busy(level):
                samples = timer.interleave(systems, args.rounds, warmup=1, reported=True)
            results[(index, level)] = {name: timer.summarize(got) for name, got in samples.items()}
    idle = results[(0, levels[0])]
    header = ["system"] + [f"{'idle' if level == 0 else f'{level} busy'} ms/token" for _, level in results]
    header += [f"{level} busy / idle" for level in levels if level]
    rows = []
    for name in systems:
        row = [name] + [results[key][name].ms(2) for key in results]
        row += [f"{results[(i, level)][name].median / idle[name].median:.2f}x" for i, level in enumerate(levels)
                if level]
        rows.append(row)
    run = record.run_record(EXPERIMENT, settings, args.threads, __file__, busy=levels, tokens=args.tokens)
    text = (f"plain decoding of {args.tokens} tokens, ms/token after the first (min / median of {args.rounds} rounds) "
            f"beside busy processes, each spinning on one core; {len(os.sched_getaffinity(0))} cores; the last column "
            f"set is idle again\n\n" + tables.markdown(header, rows))
    if "llama.cpp" not in systems:
        text += "\n\nllama.cpp: not measured (not built: benchmarks/peers/setup_llamacpp.sh, or --no-llamacpp)\n"
    record.finish(run, args.out, {"contention.md": text}, shown=text)


if __name__ == "__main__":
    main()
