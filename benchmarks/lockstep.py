"""The suite against peers: specdec, onnxruntime-genai, llama.cpp and OpenVINO GenAI request by request. Every (system,
mode) takes its turn on the same prompt before the next prompt starts, so a drift of the machine (a neighbour, the
memory bus) falls on all of them alike. The only entry point for ratios between systems.

    benchmarks/peers/setup.sh                                 # once: the peer's venv and models, tuned as its docs say
    python benchmarks/lockstep.py bundles/smollm2-q41 --backends onnxruntime,native --modes target-only,auto
    python benchmarks/lockstep.py BUNDLE --per-class 2 --modes target-only,auto --peer-modes none   # specdec only
    benchmarks/peers/setup_llamacpp.sh                        # once: llama.cpp built from source, native flags
    python benchmarks/lockstep.py BUNDLE --backends native --modes target-only,auto --peer-modes none \
        --llama-modes plain,ngram,draft --ignore-eos         # against llama.cpp's llama-server
    benchmarks/peers/setup_openvino.sh                        # once: OpenVINO GenAI's venv and its exports
    python benchmarks/lockstep.py BUNDLE --backends native --modes target-only,auto --peer-modes none \
        --ov-modes plain,draft,lookup --ov-precision int4 --ignore-eos   # against OpenVINO GenAI

specdec runs in this process (specdec.load, the runtime's own options), one system per --backends value.
onnxruntime-genai runs in a worker process of its own virtual environment (benchmarks/.peers/ortgenai: its model
builder's fp32 graph of the same weights, intra_op_num_threads = cores, inter_op_num_threads = 1, as its docs tell CPU
users to tune it), which waits on a pipe while specdec runs. llama.cpp runs one llama-server per --llama-modes value on
127.0.0.1 (benchmarks/peers/llamacpp_peer.py: threads = cores, one slot, the same GGUF specdec's default bundle is
exported from; `ngram` is its n-gram kind measured best for this model, `draft` its draft-simple with --llama-draft),
all started before the run and idle while another system runs. OpenVINO GenAI runs in a worker of its own venv
(benchmarks/peers/openvino_peer.py: one LLMPipeline per --ov-modes value on its --ov-precision export of the shared
checkpoint, PERFORMANCE_HINT LATENCY, NUM_STREAMS 1, INFERENCE_NUM_THREADS = cores; `draft` its draft_model, `lookup`
its prompt lookup); its exports round the Q4_1 weights again, so its output is compared by token agreement, not
identity. Per prompt the order of the (system, mode) pairs is rotated by one, with a short pause between requests so no
system's spinning workers overlap the next. Greedy; EOS ends a request unless --ignore-eos (every request then makes
--new-tokens tokens; onnxruntime-genai cannot). The machine's load average at the start and the end goes into the
record: llama.cpp's threads wait at their barriers by spinning, so a busy neighbour slows it far more than the others
(threads = cores assumes a quiet machine).

Writes `specdec bench`'s tables with every system in one (summary.md; summary.csv, which the docs' performance page
reads; requests.csv), pairs.md (per-prompt ratios of time per output token between pairs of modes, whose spread
shows how much of a ratio is the prompt and how much the machine; and each mode's greedy agreement with the first
system's target-only output) and record.json. No assertions (not a test).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import time
from pathlib import Path

from harness import opening, record, timer

HERE = Path(__file__).resolve().parent
EXPERIMENT = "lockstep"
PEER_SYSTEM = "onnxruntime-genai"
PEER_MODES = ("target-only", "n-gram")


class Peer:
    """The coordinator's end of a peer worker's pipe: onnxruntime-genai's (ortgenai_peer.py) or OpenVINO GenAI's
    (openvino_peer.py), each in its own venv. Its first line says it is ready and holds its settings."""

    def __init__(self, command: list, system: str | None = None):
        import subprocess

        self.system = system or PEER_SYSTEM
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()
        self.notes = self.hello["notes"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.system} worker exited (code {self.proc.wait()}); see its error above")
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


class LlamaPeer:
    """llama.cpp: one llama-server per mode (benchmarks/peers/llamacpp_peer.py), all started before the run."""

    def __init__(self, modes: dict, model: Path, ignore_eos: bool, extra: tuple = ()):
        from peers import llamacpp_peer as lc

        self.lc, self.ignore_eos, self.servers = lc, ignore_eos, {}
        try:
            for name, spec in modes.items():  # one at a time: each loads its model on a quiet machine
                self.servers[name] = lc.LlamaServer(lc.ServerSettings(model, spec, extra=extra),
                                                    log=lc.peers_dir() / "llama.cpp" / f"server-{name}.log").start()
                self.servers[name].complete([1, 2, 3], 4)  # warm-up
        except BaseException:
            self.close()
            raise
        self.notes = {name: server.settings.describe() for name, server in self.servers.items()}

    def run(self, mode: str, ids: list, new_tokens: int, prompt=None, repeat: int = 0) -> dict:
        server = self.servers[mode]
        pid, cls = (prompt.id, prompt.cls) if prompt is not None else ("-", "-")
        try:
            done = server.complete(ids, new_tokens, ignore_eos=self.ignore_eos)
        except OSError as exc:  # a request the server refused or dropped: reported as failed, never left out
            spec = server.settings.spec
            return dict(system=LLAMA_SYSTEM, mode=spec.name, drafter=spec.drafter, gamma=spec.gamma, status="failed",
                        note=f"failed: {type(exc).__name__}: {exc}"[:400], prompt_id=pid, cls=cls, repeat=repeat)
        return self.lc.record(server.settings, done, pid, cls, repeat, ids)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


LLAMA_SYSTEM = "llama.cpp"
LLAMA_MODES = ("plain", "ngram", "draft")
OV_SYSTEM = "OpenVINO GenAI"  # benchmarks/peers/openvino_peer.py's SYSTEM
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
    ((NATIVE_SYSTEM, "target-only"), (LLAMA_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "auto"), (LLAMA_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "auto"), (LLAMA_SYSTEM, "n-gram")),
    ((NATIVE_SYSTEM, "auto"), (LLAMA_SYSTEM, "draft")),
    ((NATIVE_SYSTEM, "auto"), (NATIVE_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "head"), (LLAMA_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "head"), (LLAMA_SYSTEM, "n-gram")),
    ((NATIVE_SYSTEM, "head"), (NATIVE_SYSTEM, "target-only")),
    ((LLAMA_SYSTEM, "n-gram"), (LLAMA_SYSTEM, "target-only")),
    ((LLAMA_SYSTEM, "draft"), (LLAMA_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "target-only"), (OV_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "auto"), (OV_SYSTEM, "target-only")),
    ((NATIVE_SYSTEM, "auto"), (OV_SYSTEM, "n-gram")),
    ((NATIVE_SYSTEM, "auto"), (OV_SYSTEM, "draft")),
    ((LLAMA_SYSTEM, "target-only"), (OV_SYSTEM, "target-only")),
    ((OV_SYSTEM, "n-gram"), (OV_SYSTEM, "target-only")),
    ((OV_SYSTEM, "draft"), (OV_SYSTEM, "target-only")),
)


def pair_table(records: list) -> str:
    """Per-prompt TPOT ratios of PAIRS: median, 10th and 90th percentile over prompts, and the token-weighted ratio
    (the suite's measure: total decode time over total tokens, of each side); each prompt's least disturbed repeat
    (its min TPOT over --repeats) stands for it. Beside them the median per-prompt ratio of TTFT (min over repeats)."""
    import numpy as np

    def side(system: str, prefix: str) -> tuple[dict, dict]:
        rows = [r for r in records if r.get("status") == "ok" and r["system"] == system
                and r["mode"].startswith(prefix) and r["new_tokens"] > 1]
        best, first = {}, {}
        for r in rows:
            if r["prompt_id"] not in best or r["tpot_s"] < best[r["prompt_id"]]["tpot_s"]:
                best[r["prompt_id"]] = r
            first[r["prompt_id"]] = min(first.get(r["prompt_id"], float("inf")), r["ttft_s"])
        return best, first

    lines = ["| ratio of TPOT | prompts | per prompt: median | p10 | p90 | token-weighted | TTFT ratio: median |",
             "|---|---|---|---|---|---|---|"]
    for (a_sys, a_mode), (b_sys, b_mode) in PAIRS:
        (a, a_first), (b, b_first) = side(a_sys, a_mode), side(b_sys, b_mode)
        common = sorted(set(a) & set(b))
        if not common:
            continue
        ratios = np.array([a[p]["tpot_s"] / b[p]["tpot_s"] for p in common])
        firsts = np.array([a_first[p] / b_first[p] for p in common])
        weighted = [timer.token_weighted_tpot([rows[p] for p in common]) for rows in (a, b)]
        name = f"{a_sys} {a_mode} / {b_sys} {b_mode}"
        lines.append(f"| {name} | {len(common)} | {np.median(ratios):.3f} | {np.percentile(ratios, 10):.3f} | "
                     f"{np.percentile(ratios, 90):.3f} | {weighted[0] / weighted[1]:.3f} | {np.median(firsts):.3f} |")
    return "\n".join(lines) + "\n\n(below 1: the first is faster)\n"


def agreement_table(records: list, base_system: str) -> str:
    """Each (system, mode)'s greedy output against `base_system` target-only on the same prompt (first repeat):
    prompts identical, and the mean common prefix over the longer output."""
    from specdec.bench.table import common_prefix

    base = {}
    for r in records:
        if r.get("status") == "ok" and r["system"] == base_system and r["mode"] == "target-only":
            base.setdefault(r["prompt_id"], r["token_ids"])
    rows = {}
    for r in records:
        ref = base.get(r.get("prompt_id"))
        if r.get("status") == "ok" and ref is not None and r.get("token_ids") is not None:
            same, prefix = rows.setdefault((r["system"], r["mode"]), ([], []))
            same.append(list(r["token_ids"]) == list(ref))
            prefix.append(common_prefix(r["token_ids"], ref) / max(len(r["token_ids"]), len(ref), 1))
    lines = [f"| greedy output vs {base_system} target-only | requests | identical | mean common prefix |",
             "|---|---|---|---|"]
    lines += [f"| {system} {mode} | {len(same)} | {sum(same)} | {sum(prefix) / len(prefix):.3f} |"
              for (system, mode), (same, prefix) in rows.items()]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--prompts", default=str(HERE / "prompts"))
    parser.add_argument("--per-class", type=int, default=0, help="prompts per class (0: all)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=None, help="specdec's γ (default: the bundle's)")
    parser.add_argument("--modes", default="target-only,auto,model",
                        help="specdec drafters, each DRAFTER[:γ] (target-only = none; γ: --gamma's where none is given)")
    parser.add_argument("--backends", default="onnxruntime",
                        help="specdec's backends, each a system of its own: onnxruntime (system specdec), native "
                             f"(system {NATIVE_SYSTEM!r}); comma-separated")
    parser.add_argument("--peer-gamma", type=int, default=4, help="the peer's n-gram max_draft_tokens")
    parser.add_argument("--peer-modes", default=",".join(PEER_MODES), help="'none' to run specdec alone")
    parser.add_argument("--peers-dir", default=str(HERE / ".peers"), help="venvs and models from peers/setup.sh")
    parser.add_argument("--llama-modes", default="none",
                        help=f"llama.cpp's modes, comma-separated among {', '.join(LLAMA_MODES)} (default none)")
    parser.add_argument("--llama-model", default=None, help="llama.cpp's GGUF (default: the default model's Q4_1)")
    parser.add_argument("--llama-draft", default=None,
                        help="llama.cpp's draft GGUF for `draft` (default: the default model's Q4_1 GGUF)")
    parser.add_argument("--llama-draft-max", type=int, default=3, help="its --spec-draft-n-max (default 3, its own)")
    parser.add_argument("--llama-ngram", default=None,
                        help="llama.cpp's `ngram` as KIND:N:M, e.g. ngram-simple:3:8 (default: the one its sweep "
                             "measured best for the default model, llamacpp_peer.BEST_NGRAM)")
    parser.add_argument("--llama-extra", default="",
                        help="more llama-server flags, as one string (e.g. '--no-repack' where its repacked AMX "
                             "products crash); written to the record")
    parser.add_argument("--ov-modes", default="none",
                        help="OpenVINO GenAI's modes, comma-separated among plain, draft, lookup (default none; "
                             "benchmarks/peers/setup_openvino.sh first)")
    parser.add_argument("--ov-precision", default="int4", choices=("int4", "int8", "fp16"),
                        help="which of its exports of the shared checkpoint it runs (default int4: NNCF asymmetric, "
                             "groups of 32)")
    parser.add_argument("--ov-draft", default=None,
                        help="its draft model's folder for `draft` (default: its int4 export of the same model)")
    parser.add_argument("--ov-assistant-tokens", type=int, default=5,
                        help="its num_assistant_tokens for draft and lookup (default 5, its own)")
    parser.add_argument("--ov-ngram", type=int, default=3, help="its max_ngram_size for lookup (default 3)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request makes --new-tokens tokens (specdec, llama.cpp and OpenVINO GenAI; not "
                             "onnxruntime-genai)")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between requests")
    opening.add_out(parser)
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
    worker = HERE / "peers" / "ortgenai_peer.py"  # runs in the peer's venv, without specdec
    command = [str(python), str(worker), "--worker", str(Path(args.peers_dir) / "models"), str(args.peer_gamma)]
    return Peer(command), peer_modes


def open_llama(args):
    """llama.cpp's servers, one per --llama-modes value, or None."""
    names = [] if args.llama_modes == "none" else [m.strip() for m in args.llama_modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in LLAMA_MODES]
    if unknown:
        raise SystemExit(f"unknown llama.cpp mode {unknown[0]!r}; choose from {', '.join(LLAMA_MODES)} or none")
    if not names:
        return None
    from peers import llamacpp_peer as lc

    if not lc.built():
        raise SystemExit(f"no llama-server at {lc.binary()}; run benchmarks/peers/setup_llamacpp.sh first, or pass "
                         "--llama-modes none")
    model = Path(args.llama_model) if args.llama_model else lc.default_gguf()
    draft = lc.Draft(Path(args.llama_draft) if args.llama_draft else lc.default_gguf(), n_max=args.llama_draft_max)
    try:
        ngram = lc.ngram_from_text(args.llama_ngram) if args.llama_ngram else lc.BEST_NGRAM
    except ValueError as exc:
        raise SystemExit(f"--llama-ngram: {exc}") from None
    kinds = {"plain": lc.Plain(), "ngram": ngram, "draft": draft}
    return LlamaPeer({name: kinds[name] for name in names}, model, args.ignore_eos, tuple(shlex.split(args.llama_extra)))


def open_openvino(args):
    """OpenVINO GenAI's worker (one pipeline per --ov-modes value, in its venv) and its settings, or (None, None)."""
    from peers import openvino_peer as ovp

    names = [] if args.ov_modes == "none" else [m.strip() for m in args.ov_modes.split(",") if m.strip()]
    try:
        settings = ovp.Settings(Path(args.peers_dir), args.ov_precision, tuple(names), draft=args.ov_draft,
                                assistant_tokens=args.ov_assistant_tokens, max_ngram_size=args.ov_ngram,
                                ignore_eos=args.ignore_eos) if names else None
    except ValueError as exc:
        raise SystemExit(f"--ov-*: {exc}") from None
    if settings is None:
        return None, None
    if not ovp.installed(settings.peers):
        raise SystemExit(f"no OpenVINO GenAI venv at {ovp.python(settings.peers).parents[1]}; run "
                         "benchmarks/peers/setup_openvino.sh first, or pass --ov-modes none")
    needed = [settings.model] + ([settings.draft_model] if "draft" in names else [])
    missing = [m for m in needed if not (m / "openvino_model.xml").is_file()]
    if missing:
        raise SystemExit(f"no OpenVINO export at {missing[0]}; run benchmarks/peers/setup_openvino.sh (its int4, "
                         "int8 and fp16 exports), or name another --ov-draft")
    peer = Peer(settings.command(), OV_SYSTEM)
    return peer, ovp.record_settings(settings, peer.hello)


def specdec_modes(args, gamma: int) -> list:
    """--modes' DRAFTER[:γ] items (target-only = none; γ: --gamma or the bundle's where an item names none)."""
    from specdec.bench.config import BASELINE, Mode

    modes = opening.parse_modes(args.modes, {BASELINE: "none"})
    return [Mode(BASELINE, "none") if drafter == "none" else Mode(f"{drafter} γ={own or gamma}", drafter, own or gamma)
            for drafter, own in modes]


def run_turns(generators: dict, peers: dict, turns: list, prompts: list, ids: dict, args) -> list:
    """Warm-up (not recorded), then repeats × prompts × turns, the turns rotated by one per prompt."""
    from tqdm import tqdm

    from specdec.bench.run import record_from_result
    from specdec.runtime.config import GenerationConfig

    eos = () if args.ignore_eos else None  # (): no EOS ids; None: the bundle's

    def one(system, mode, prompt, repeat: int, new_tokens: int) -> dict:
        if system not in generators:
            return peers[system].run(mode, ids[prompt.id], new_tokens, prompt, repeat)
        config = GenerationConfig(max_new_tokens=new_tokens, drafter=mode.drafter, gamma=mode.gamma,
                                  eos_token_ids=eos)
        result, elapsed = timer.timed(lambda: generators[system].generate(ids[prompt.id], config))
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
    if args.ignore_eos and args.peer_modes != "none":
        raise SystemExit("onnxruntime-genai cannot ignore EOS: pass --peer-modes none with --ignore-eos")
    specdec_modes(args, 1)  # refuses a bad item before a peer or a bundle opens
    with contextlib.ExitStack() as stack:
        peer, peer_modes = open_peer(args)
        if peer is not None:
            stack.callback(peer.close)
        llama = open_llama(args)
        if llama is not None:
            stack.callback(llama.close)
        openvino, openvino_settings = open_openvino(args)
        if openvino is not None:
            stack.callback(openvino.close)
        peers = {name: p for name, p in ((PEER_SYSTEM, peer), (LLAMA_SYSTEM, llama), (OV_SYSTEM, openvino))
                 if p is not None}
        generators = {SYSTEMS[b]: stack.enter_context(opening.open_bundle(args.bundle, b)) for b in backends}
        generator = next(iter(generators.values()))
        modes = specdec_modes(args, args.gamma or generator.manifest.defaults.gamma)
        every = read_prompts(args.prompts)
        ids = prompt_ids(generator, every)
        room = generator.manifest.target.max_seq_len - args.new_tokens - 1
        prompts = select_prompts(every, {k: len(v) for k, v in ids.items()}, args.per_class, room)
        turns = [(s, m) for s in generators for m in modes] + [(PEER_SYSTEM, m) for m in peer_modes]
        turns += [(LLAMA_SYSTEM, m) for m in (llama.servers if llama is not None else ())]
        turns += [(OV_SYSTEM, m) for m in (openvino.notes if openvino is not None else ())]
        settings = {system: opening.describe(g) for system, g in generators.items()}
        if peer is not None:
            settings[PEER_SYSTEM] = {"modes": peer.notes, "max_draft_tokens": args.peer_gamma}
        if llama is not None:
            settings[LLAMA_SYSTEM] = {"modes": llama.notes}
        if openvino is not None:
            settings[OV_SYSTEM] = openvino_settings
        run = record.run_record(EXPERIMENT, settings, None, __file__, None, prompts=len(prompts),
                                new_tokens=args.new_tokens, repeats=args.repeats, ignore_eos=args.ignore_eos,
                                order="per prompt, every (system, mode) in turn, rotated by one per prompt",
                                load_average_start=os.getloadavg(), niceness=os.nice(0))
        records = run_turns(generators, peers, turns, prompts, ids, args)
        pair = describe_pair(generator.manifest) + "".join(  # the models' precisions, and what native multiplies in
            f"; {system} activations {g.activations}" for system, g in generators.items() if "native" in str(g.backend))
    folder = record.run_dir(EXPERIMENT, run, args.out)
    info = dict(bundle=args.bundle, prompts=len(prompts), classes=sorted({p.cls for p in prompts}),
                modes=[f"{s}: {m if isinstance(m, str) else m.name}" for s, m in turns], repeats=args.repeats,
                max_new_tokens=args.new_tokens, temperature=0.0, warmup=1, seed=0, command=run["command"],
                models=pair, date=run["started"])
    paths = write_outputs(records, folder, info, plots=False)
    paths["run"].unlink()  # record.json replaces it
    pairs = pair_table(records) + "\n" + agreement_table(records, next(iter(generators)))
    record.finish(run, folder, {"pairs.md": pairs}, shown=paths["markdown"].read_text(encoding="utf-8") + "\n" + pairs,
                  models=pair, load_average_end=os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
