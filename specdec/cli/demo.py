"""`python -m specdec.cli.demo BUNDLE`: a speculative generation, and its speedup over plain decoding measured in
the same run (interleaved repeats; min and median ms/token per mode), on each backend in turn (onnxruntime, then
the native kernels where the bundle and this machine allow them); greedy outputs identical across drafters and
backends (a native target in int8 activations, another function, is compared with the first backend's and not
required to equal it)."""
from __future__ import annotations

import argparse
import statistics
import sys

from specdec.errors import SpecDecError
from specdec.native_record import Activations
from specdec.runtime import GenerationConfig, load
from specdec.runtime.config import BackendName, DrafterName

PROMPTS = [
    "Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate, "
    "and the committee published the new budget on Monday.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What are three tips for staying productive when working from home?",
]
MODES = (DrafterName.NONE, DrafterName.AUTO, DrafterName.PROMPT_LOOKUP, DrafterName.MODEL)
NO_HEAD = ("\nno trained draft head in this bundle: `make bundle-head` trains one from the target on this CPU "
           "(bundles/smollm2-q41-head, docs/heads.md), and `make demo` then shows drafter 'head' too")


def modes_of(generator) -> tuple:
    """MODES, and the head where the bundle has one its target on this backend can feed."""
    runs_head = generator.requests.head is not None and generator.requests.head_problem is None
    return MODES + ((DrafterName.HEAD,) if runs_head else ())


def measure(generator, modes, new_tokens: int, repeats: int) -> dict:
    """(ms/token samples per mode, interleaved so machine noise hits every mode alike; greedy tokens per prompt)."""
    samples = {mode: [] for mode in modes}
    texts = {}
    for _ in range(repeats):
        for prompt in PROMPTS:
            for mode in modes:
                config = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, drafter=mode, chat=True)
                result = generator.generate(prompt, config)
                stats = result.stats
                decode_s = stats.total_s - stats.prefill_s
                samples[mode].append((decode_s * 1e3 / max(1, len(result.token_ids)), stats))
                texts.setdefault(prompt, {})[mode] = result.token_ids
    for prompt, by_mode in texts.items():
        if any(ids != by_mode[DrafterName.NONE] for ids in by_mode.values()):
            raise SystemExit(f"greedy outputs differ between drafters for {prompt!r}")
    return samples, {prompt: by_mode[DrafterName.NONE] for prompt, by_mode in texts.items()}


def report(samples: dict, base: float) -> str:
    """The table of one backend; speedup over `base` (median ms/token of the first backend's plain decoding)."""
    lines = [f"{'drafter':<14} {'min ms/tok':>10} {'median':>8} {'speedup':>8} {'accept':>7} {'host %':>7}"]
    for mode, rows in samples.items():
        times = [ms for ms, _ in rows]
        proposed = sum(s.proposed for _, s in rows)
        accepted = sum(s.accepted for _, s in rows)
        host = sum(s.host_s for _, s in rows) / sum(s.total_s for _, s in rows)
        rate = f"{accepted / proposed:.2f}" if proposed else "-"
        lines.append(f"{mode:<14} {min(times):>10.1f} {statistics.median(times):>8.1f} "
                     f"{base / statistics.median(times):>7.2f}x {rate:>7} {100 * host:>6.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bundle")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", default=f"{BackendName.ONNXRUNTIME},{BackendName.NATIVE}",
                        help="comma-separated; a backend after the first that cannot open here is skipped with why")
    args = parser.parse_args(argv)
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    base, outputs = None, {}
    for index, backend in enumerate(backends):
        try:
            generator = load(args.bundle, backend=backend)
        except SpecDecError as exc:
            if index == 0:
                raise
            print(f"\n[{backend}] skipped: {exc}")
            continue
        with generator:
            generator.generate("Hello", GenerationConfig(max_new_tokens=4))  # warm-up
            if index == 0:
                print(f"prompt: {PROMPTS[0]}\n---")
                for piece in generator.stream(PROMPTS[0], GenerationConfig(max_new_tokens=args.new_tokens, chat=True)):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                print(f"\n--- [auto] {generator.last_stats.summary()}\n")
            samples, texts = measure(generator, modes_of(generator), args.new_tokens, args.repeats)
            has_head = generator.requests.head is not None
            activations = generator.activations
        name = backend if activations is Activations.FP32 else f"{backend}, {activations} activations"
        if index and activations is not Activations.FP32:  # another function than fp32's: compared, not required
            same = sum(outputs.get(prompt) == ids for prompt, ids in texts.items())
            agreement = (f"; {same} of {len(texts)} prompts' outputs equal the {backends[0]} backend's (fp32: "
                         "--activations fp32 gives its output exactly, docs/backends.md)")
        else:
            for prompt, ids in texts.items():
                if outputs.setdefault(prompt, ids) != ids:
                    raise SystemExit(f"greedy outputs differ between backends for {prompt!r}")
            agreement = " and backends" if index else ""
        print(f"\n[{name}] greedy, {len(PROMPTS)} prompts x {args.repeats} repeats, {args.new_tokens} new tokens, "
              "outputs identical across drafters" + agreement +
              (f"; speedup over the {backends[0]} backend's plain decoding:" if index else ":"))
        base = base or statistics.median(ms for ms, _ in samples[DrafterName.NONE])
        print(report(samples, base))
    if not has_head:
        print(NO_HEAD)
    return 0


def _main() -> int:
    try:
        return main()
    except SpecDecError as exc:  # a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_main())
