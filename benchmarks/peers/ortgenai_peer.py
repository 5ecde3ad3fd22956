"""Peer: onnxruntime-genai 0.18 on CPU (runs in benchmarks/.peers/ortgenai; it brings its own onnxruntime).

The models are built from the same HF weights by its model builder (fp32, CPU), run with the session options
setup.sh writes (intra_op_num_threads = cores, tune_config.py). Modes: plain greedy decoding; its n-gram speculative
decoding (set_speculative_options(ngram_size=...)); its draft-model speculative decoding with a K-layer truncated
copy built by the same builder (a composite genai_config with model.draft); and plain decoding of the builder's
INT4 graph (-p int4: another model, for its per-token cost). A mode the installed version refuses is recorded as
failed with its error.

    python benchmarks/peers/ortgenai_peer.py --bundle B --models benchmarks/.peers/models --prompts benchmarks/prompts \
        --out peer.jsonl                      # the whole suite, JSONL records for `specdec bench --peers DIR`
    python benchmarks/peers/ortgenai_peer.py --worker MODELS GAMMA   # lockstep.py's worker: one request per line
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from peer_common import PeerMode, peer_main, record

SYSTEM = "onnxruntime-genai"


def generate_fn(og, model, speculative: dict | None = None):
    def run(ids: list, new_tokens: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
        if speculative:
            params.set_speculative_options(**speculative)
        started = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        first = None
        while not generator.is_done():
            generator.generate_next_token()
            if first is None:
                first = time.perf_counter()
        e2e = time.perf_counter() - started
        tokens = list(generator.get_sequence(0))[len(ids):]
        extra = stats_of(generator) if speculative is not None else {}
        return tokens, (first or time.perf_counter()) - started, e2e, extra

    return run


def stats_of(generator) -> dict:
    stats = generator.get_speculative_stats()
    proposed = int(stats.get("draft_tokens_evaluated", 0))
    accepted = int(stats.get("draft_tokens_accepted", 0))
    passes = int(stats.get("target_forward_passes", 0))  # every target pass: verify, plain steps on misses, ...
    return dict(proposed=proposed, accepted=accepted, verify_passes=passes,
                acceptance_rate=accepted / proposed if proposed else None)


def fp32_modes(og, models: Path, gamma: int) -> tuple:
    """(note prefix with the settings, plain mode, n-gram mode) of the fp32 builder graph; also lockstep.py's."""
    target = og.Model(str(models / "ortgenai-fp32"))
    options = json.loads((models / "ortgenai-fp32" / "genai_config.json").read_text())["model"]["decoder"].get(
        "session_options", {})
    base = (f"onnxruntime-genai {og.__version__}, model builder fp32 CPU, intra_op_num_threads="
            f"{options.get('intra_op_num_threads', 'default')}, inter_op_num_threads="
            f"{options.get('inter_op_num_threads', 'default')}")
    plain = PeerMode("target-only", "none", 0, f"{base}; greedy", generate_fn(og, target))
    ngram = PeerMode(f"n-gram γ={gamma}", "prompt_lookup", gamma,
                     f"{base}; its n-gram speculative decoding (ngram_size=3: matches the last 2 tokens, "
                     f"max_draft_tokens={gamma})",
                     generate_fn(og, target, dict(ngram_size=3, max_draft_tokens=gamma)))
    return base, plain, ngram


def modes(args) -> list:
    import onnxruntime_genai as og

    models = Path(args.models)
    base, plain, ngram = fp32_modes(og, models, args.gamma)
    spec_dir = models / f"ortgenai-spec-layers{args.layers}"
    note = (f"{base}; its draft-model speculative decoding, draft = first {args.layers} layers of the same weights "
            "(fp32, closest equivalent of the INT4 self-draft)")
    try:
        draft = PeerMode(f"draft {args.layers}-layer γ={args.gamma}", "model", args.gamma, note,
                         generate_fn(og, og.Model(str(spec_dir)), dict(max_draft_tokens=args.gamma)))
    except Exception as exc:  # the installed version may refuse the composite configuration
        draft = PeerMode(f"draft {args.layers}-layer γ={args.gamma}", "model", args.gamma,
                         f"{note}; failed to load: {type(exc).__name__}: {exc}"[:400], None, "failed")
    int4_dir = models / "ortgenai-int4"
    int4_note = "onnxruntime-genai model builder INT4 CPU graph (MatMulNBits, accuracy level 4); greedy"
    if (int4_dir / "genai_config.json").is_file():
        int4 = PeerMode("int4 target-only", "none", 0, int4_note, generate_fn(og, og.Model(str(int4_dir))))
    else:
        int4 = PeerMode("int4 target-only", "none", 0, f"{int4_note}; not built (setup.sh)", None, "unsupported")
    return [plain, ngram, draft, int4]


def worker(models: str, gamma: int) -> int:
    """lockstep.py's peer: reads {"mode", "ids", "new_tokens", "prompt", "repeat"} lines, answers one record per line
    (status "failed" with the error where a request fails). Plain and n-gram modes of the fp32 graph."""
    import onnxruntime_genai as og

    _, plain, ngram = fp32_modes(og, Path(models), gamma)
    by_name = {"target-only": plain, "n-gram": ngram}
    plain.run([1, 2, 3], 4)  # warm-up
    print(json.dumps({"ready": True, "notes": {name: mode.note for name, mode in by_name.items()}}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        mode = by_name[ask["mode"]]
        named = PeerMode(ask["mode"], mode.drafter, mode.gamma, mode.note, mode.run)
        try:
            result = mode.run(ask["ids"], ask["new_tokens"])
            answer = record(SYSTEM, named, ask["prompt"], ask["repeat"], ask["ids"], result)
        except Exception as exc:  # reported in the table as a failed request, never dropped
            answer = dict(system=SYSTEM, mode=named.name, drafter=named.drafter, gamma=named.gamma, status="failed",
                          note=f"{named.note}; failed: {type(exc).__name__}: {exc}"[:400],
                          prompt_id=ask["prompt"]["id"],
                          cls=ask["prompt"]["class"], repeat=ask["repeat"])
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        raise SystemExit(worker(sys.argv[2], int(sys.argv[3])))
    raise SystemExit(peer_main(SYSTEM, __doc__, modes))
