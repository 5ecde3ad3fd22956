"""What one forward pass costs: a decode step (T = 1), a verify pass (T = γ+1, every row scored) and a prompt chunk
(its last row scored), at several cache lengths, for each model of each bundle on each backend, interleaved.

    python benchmarks/step.py bundles/smollm2-q41                                 # target and draft, backend auto
    python benchmarks/step.py bundles/smollm2-q41 --backends onnxruntime,native --roles target
    python benchmarks/step.py OLD NEW --backends onnxruntime --rounds 8           # two exports of one model
    python benchmarks/step.py bundles/smollm2-q41 --floor                         # against the bandwidth floor
    python benchmarks/step.py bundles/smollm2-q41 --by-op --backends onnxruntime  # where a step spends its time
    python benchmarks/step.py bundles/smollm2-bf16-q41 --backends native --pages private,shared  # huge pages or not
    python benchmarks/step.py bundles/smollm2-q41 --backends native --isa avx2,avx512          # the kernels' ISA
    python benchmarks/step.py bundles/smollm2-q41 --backends native --activations fp32,int8    # int8 activations
    python benchmarks/step.py bundles/smollm2-q41-head --roles target,head --cases 1@64,1@512,3@64  # a draft head

Roles: target, draft, head (a bundle's trained draft head, harness/opening.HeadSteps: T = 1 is a chain step, T > 1 a
catch-up of T verified positions, fc included). Where a system has a head and a target, a second table sets each
head case against the target's decode step (T = 1) at the same cache length: min over min, and the median of the
ratios of the same round (the head's cost c in target steps).

Models are opened through specdec.load, so a call runs the backend, threads and session options a user gets. Every
(model, case) takes its turn in each round, the order rotated per round, after a warm-up call of every shape.
A case T@L is a forward of T tokens at cache length L; one that does not fit the bundle's S is left out.

--floor adds the memory-bandwidth floor of a plain step: the bytes its kernels read (every weight of the target's
ONNX graph but an embedding table, of which one row is read, plus the valid KV) over the read bandwidth of this
machine, measured two ways in the same run (numpy XOR-reductions, one thread per core; onnxruntime's fp32 GEMV).
A shared machine's bandwidth drifts by half within a minute, so it also pairs them: for each target, a reader of that
target's own step bytes (its native weights where it has them) takes its turn in every round, and the target's decode
step at --floor-cache-len is set against it: min step / min read, and the median of step / read of the same round.
Needs `onnx` (the [native] or [export] extra).
--by-op adds onnxruntime's profiler view (onnxruntime backend only): per op type, the sum over nodes of each node's
minimum over the calls, for T = 1 and the widest verify case. The profiler makes small kernels look dearer.

--pages opens the native backend once per way of holding its weights (SPECDEC_NATIVE_PAGES: private copies on huge
pages, or the bundle's file mapped shared), each a model of its own in the same rounds; --isa once per instruction set
of its kernels (SPECDEC_NATIVE_ISA: avx2, avx512), the same way; --activations once per mode of its target's
activations (load(activations=...): fp32, int8).

Writes step.md (the tables), steps.csv and record.json. A benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import threading
from pathlib import Path

import numpy as np
from harness import opening, record, tables, timer

from specdec.native_record import ACTIVATIONS
from specdec.weights_file import PAGES
from specdec.native.build import ISAS

EXPERIMENT = "step"
DEFAULT_CASES = "1@64,1@512,1@1000,5@512,64@0"
ROLES = ("target", "draft", "head")


def parse_cases(text: str) -> list:
    """'T@L,...' -> [(T, L)]."""
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        tokens, _, cache = item.partition("@")
        if not tokens.isdigit() or not cache.isdigit() or int(tokens) < 1:
            raise SystemExit(f"case {item!r} is not T@L (tokens at cache length), e.g. 1@64")
        cases.append((int(tokens), int(cache)))
    return cases


def label(case: tuple, gamma_max: int) -> str:
    tokens, cache = case
    kind = "decode" if tokens == 1 else "verify" if tokens <= gamma_max + 1 else "prefill"
    return f"{kind} T={tokens} @{cache}"


def call(backend, case: tuple, gamma_max: int):
    """A callable running one forward of `case` on `backend` (slot 0)."""
    tokens, cache = case
    ids = np.full((1, tokens), 5, dtype=np.int64)  # [1, T]
    cache_len = np.array([cache], dtype=np.int64)  # [1]
    last_only = tokens > gamma_max + 1  # a prompt chunk scores its last row only, as the runtime feeds it
    return lambda: backend.forward(ids, cache_len, last_only=last_only)


def _opened(stack: contextlib.ExitStack, bundle, backend: str, threads, pages: str | None, isa: str | None,
            activations: str | None = None):
    """A generator of `bundle`, its native weights held as `pages` says, its kernels built for `isa` (None: as
    this process would) and its target's activations `activations` (None: the bundle's default); each instruction set
    loads a library of its own, so both run in one process."""
    with opening.native_env(pages=pages, isa=isa):
        return stack.enter_context(opening.open_bundle(bundle, backend, threads, activations=activations))


def open_all(stack: contextlib.ExitStack, bundles: list, backends: list, roles: list, threads,
             pages: list = (None,), isas: list = (None,), activations: list = (None,)) -> tuple:
    """({model label: backend}, {system label: settings}, {model label: its bundle}) over bundles × backends × roles
    (× pages × instruction sets × activations, native only)."""
    models, settings, sources = {}, {}, {}
    names = [Path(b).name for b in bundles]
    variants = [(p, i, a) for p in pages for i in isas for a in activations]
    for bundle, name in zip(bundles, names):
        name = name if names.count(name) == 1 else str(bundle)
        for backend, (held, isa, mode) in ((b, v) for b in backends
                                           for v in (variants if b == "native" else [(None, None, None)])):
            generator = _opened(stack, bundle, backend, threads, held, isa, mode)
            label = ", ".join([f"{held} pages"] * bool(held) + [isa] * bool(isa) + [str(mode)] * bool(mode))
            system = f"{name} ({generator.backend}{f', {label}' if label else ''})"
            settings[system] = (opening.describe(generator) | {"threads": threads} | ({"pages": held} if held else {})
                                | ({"native_isa": isa} if isa else {}) | {"activations": str(generator.activations)})
            for role, model in opening.models(generator).items():  # the target first: a draft may share its KV
                model.reset(1)
                if role in roles:
                    models[f"{system} {role}"] = (model, generator.manifest)
                    sources[f"{system} {role}"] = Path(bundle)
    return models, settings, sources


def measure(models: dict, cases: list, rounds: int, extra: dict | None = None) -> dict:
    """{(model label, case) or an `extra` name: [seconds per call, in round order]} of interleaved calls."""
    work = dict(extra or {})
    for name, (model, manifest) in models.items():
        gamma_max = manifest.defaults.gamma_max
        for case in cases:
            if case[0] + case[1] <= model.max_seq_len:
                work[(name, case)] = call(model, case, gamma_max)
    return timer.interleave(work, rounds=rounds, warmup=1)


def step_table(models: dict, cases: list, spreads: dict) -> str:
    gamma_max = max(manifest.defaults.gamma_max for _, manifest in models.values())
    header = ["model"] + [label(case, gamma_max) for case in cases]
    rows = [[name] + [spreads[(name, case)].ms() if (name, case) in spreads else "–" for case in cases]
            for name in models]
    return tables.markdown(header, rows) + "\n(ms per call, min / median over the rounds)\n"


def head_table(samples: dict, models: dict, cases: list) -> tuple[str, list]:
    """Each head case against its system's target decode step at the same cache length -> (markdown, rows)."""
    rows, found = [], []
    for name in models:
        if not name.endswith(" head"):
            continue
        target = name[: -len(" head")] + " target"
        for tokens, cache in cases:
            head, step = samples.get((name, (tokens, cache))), samples.get((target, (1, cache)))
            if head is None or step is None:
                continue
            paired = sorted(h / t for h, t in zip(head, step))
            ratio_min, ratio_median = min(head) / min(step), paired[len(paired) // 2]
            rows.append([name, f"T={tokens} @{cache}", f"{min(head) * 1e3:.3f}", f"{min(step) * 1e3:.3f}",
                         f"{ratio_min:.3f}", f"{ratio_median:.3f}"])
            found.append({"model": name, "tokens": tokens, "cache_len": cache,
                          "head_over_step_min": round(ratio_min, 4), "head_over_step_median": round(ratio_median, 4)})
    if not rows:
        return "", found
    header = ["head", "case", "head min ms", "target T=1 min ms", "min / min", "median of same-round ratios"]
    title = "\nThe head against the target's decode step at the same cache length\n\n"
    return title + tables.markdown(header, rows), found


def csv_rows(spreads: dict, models: dict) -> list:
    rows = []
    for (name, case), spread in spreads.items():
        gamma_max = models[name][1].defaults.gamma_max
        rows.append({"model": name, "case": label(case, gamma_max), "tokens": case[0], "cache_len": case[1],
                     "calls": spread.n, "min_ms": round(spread.min * 1e3, 4),
                     "median_ms": round(spread.median * 1e3, 4), "max_ms": round(spread.max * 1e3, 4)})
    return rows


# --- the bandwidth floor -------------------------------------------------------------------------------------------

class Reader:
    """A callable that reads `nbytes` once, XOR-reducing with one thread per core (the way numpy_read_gbs does): its
    time is the bandwidth floor of a step of `nbytes`, at the moment it runs. `arrays`: read these (a native model's
    own weights, on the pages the step reads) and a buffer of its own for the rest of `nbytes` (the KV)."""

    def __init__(self, nbytes: int, arrays: list = ()):
        self.cores = len(os.sched_getaffinity(0))
        spans = [_words(array) for array in _merged(arrays)]
        rest = nbytes - sum(span.nbytes for span in spans)
        spans.append(np.ones(max(rest // 8, self.cores), dtype=np.uint64))
        self.nbytes = sum(span.nbytes for span in spans)
        self.parts = [[] for _ in range(self.cores)]  # each thread's share of every span: equal bytes per thread
        for span in spans:
            for part, piece in zip(self.parts, np.array_split(span, self.cores)):
                part.append(piece)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.cores)

    def __call__(self) -> None:
        list(self.pool.map(_xor_all, self.parts))

    def close(self) -> None:
        self.pool.shutdown()


def _xor_all(pieces: list) -> None:
    for piece in pieces:
        np.bitwise_xor.reduce(piece)


def _words(array: np.ndarray) -> np.ndarray:
    """A byte array's whole uint64 words."""
    return array[: array.nbytes // 8 * 8].view(np.uint64)


def _merged(arrays: list, gap: int = 1 << 16) -> list:
    """Byte views of `arrays`' memory, where adjacent (within `gap` bytes) arrays of one buffer become one view: a
    native model's tensors lie in one file's buffer in order, so a step's weights are a few long spans."""
    found = []
    for array in arrays:
        root = array
        while isinstance(root.base, np.ndarray):
            root = root.base
        start = array.ctypes.data - root.ctypes.data
        found.append((id(root), start, start + array.nbytes, root))
    spans = []
    for key, start, end, root in sorted(found, key=lambda item: item[:3]):
        if spans and spans[-1][0] == key and start <= spans[-1][2] + gap:
            spans[-1][2] = max(spans[-1][2], end)
        else:
            spans.append([key, start, end, root])
    return [root.reshape(-1).view(np.uint8)[start:end] for _, start, end, root in spans]


def step_arrays(backend) -> list:
    """The arrays a native backend's one-token step reads whole (every layer's weights, norms and biases, the final
    norm and the head), or [] for any other backend (the reader then reads a buffer of its own)."""
    model = getattr(backend, "model", None)
    weights = getattr(model, "weights", None)
    if weights is None or getattr(model, "draft", None) is not None:
        return []
    arrays = [weights.final_norm, weights.head] + [weights.final_norm_bias] * (weights.final_norm_bias is not None)
    for layer in weights.layers:
        arrays += [value for value in vars(layer).values() if isinstance(value, np.ndarray)]
    return arrays


def paired_floor(samples: dict, models: dict, case: tuple, readers: dict) -> tuple:
    """(markdown, {model: {...}}): each target's step time at `case` against its Reader's (`readers`: {model label:
    reader name}), the time to read that target's own bytes at this machine's bandwidth. Two views: the least
    disturbed of each (min step / min read), and the median over rounds of step / read in the same round (a
    neighbour's burst in one round moves both, or one ratio only)."""
    rows, found = [], {}
    for name in models:
        if name not in readers or (name, case) not in samples:
            continue
        steps, reads = samples[(name, case)], samples[readers[name]]
        least = min(steps) / min(reads)
        median = timer.summarize([step / read for step, read in zip(steps, reads)]).median
        found[name] = {"min_over_min": round(least, 3), "median_paired": round(median, 3), "rounds": len(steps)}
        rows.append([name, readers[name], f"{least:.2f}×", f"{median:.2f}×", str(len(steps))])
    header = ["model", "its bytes read", "min step / min read", "median of step / read, same round", "rounds"]
    return tables.markdown(header, rows), found


def numpy_read_gbs(gib: float, repeats: int) -> float:
    """Best aggregate read bandwidth (GB/s) of one XOR-reducing thread per core over one large uint64 buffer (the
    reduction is one cheap op per 8 bytes, so the loop waits on memory; numpy drops the GIL in it)."""
    cores = len(os.sched_getaffinity(0))
    data = np.ones(int(gib * 2**30) // 8, dtype=np.uint64)
    parts = np.array_split(data, cores)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.bitwise_xor.reduce, args=(part,)) for part in parts]
        _, seconds = timer.timed(lambda: _run_all(workers))
        best = max(best, data.nbytes / seconds / 1e9)
    return best


def _run_all(workers: list) -> None:
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def gemv_read_gbs(gib: float, repeats: int) -> float:
    """Best bandwidth (GB/s) of onnxruntime's fp32 MatMul at M = 1 over a constant [K, N] weight of `gib` GiB, on
    the runtime's own session options: the kernel that reads a plain fp32 step's weights."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdec.runtime.backend import session_options

    k = 1024
    weight = np.random.default_rng(0).standard_normal((k, int(gib * 2**30) // 4 // k), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, weight.shape[1]])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    x = np.ones((1, k), np.float32)
    run = lambda: session.run(None, {"x": x})
    best = min(timer.interleave({"gemv": run}, rounds=repeats)["gemv"])
    return weight.nbytes / best / 1e9


def step_bytes(bundle: Path, entry, cache_len: int) -> tuple:
    """(weight bytes a T = 1 step reads, KV bytes at `cache_len`) of a bundle model's ONNX graph."""
    import onnx

    model = onnx.load(str(Path(bundle) / entry.onnx_path), load_external_data=False)
    sizes = {init.name: int(np.prod(init.dims)) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
             for init in model.graph.initializer}
    # a Gather reads one row per token: its table counts only where another kernel reads it whole (a tied head)
    read = {name for node in model.graph.node if node.op_type != "Gather" for name in node.input if name in sizes}
    dims = entry.dims
    kv = 2 * dims.num_layers * dims.num_kv_heads * cache_len * dims.head_dim * np.dtype(np.float32).itemsize
    return sum(sizes[name] for name in read), kv


def native_step_bytes(entry) -> int | None:
    """Weight bytes a native step reads: every tensor of the target's native weights but the tables it reads one row
    of (an untied embedding, the rotary or learned position tables), or None without native weights."""
    if entry.native is None:
        return None
    from specdec.weight_kinds import DTYPES

    return sum(int(np.prod(spec["shape"])) * DTYPES[spec["kind"]].itemsize
               for name, spec in entry.native.tensors.items() if name not in ("embedding", "cos", "sin", "positions"))


def floor_step_bytes(bundle: Path, entry, cache_len: int) -> tuple:
    """(weight bytes, KV bytes) of a step on the engine that reads the fewest: the native weights where the entry
    has them, else its ONNX graph's."""
    weights, kv = step_bytes(bundle, entry, cache_len)
    native = native_step_bytes(entry)
    return (weights if native is None else native), kv


def floor_table(bundle: Path, manifest, cache_len: int, gib: float, repeats: int) -> tuple:
    weights, kv = step_bytes(bundle, manifest.target, cache_len)
    native = native_step_bytes(manifest.target)
    numpy_gbs, gemv_gbs = numpy_read_gbs(gib, repeats), gemv_read_gbs(gib, repeats)
    total = weights + kv
    rows = [["weight bytes a step reads (ONNX graph)", f"{weights / 1e6:.1f} MB"],
            [f"KV bytes at cache length {cache_len}", f"{kv / 1e6:.1f} MB"],
            ["read bandwidth, numpy XOR-reduce, one thread per core", f"{numpy_gbs:.1f} GB/s"],
            ["read bandwidth, onnxruntime fp32 GEMV", f"{gemv_gbs:.1f} GB/s"],
            ["floor at the numpy bandwidth", f"{total / numpy_gbs / 1e6:.2f} ms"],
            ["floor at the GEMV bandwidth", f"{total / gemv_gbs / 1e6:.2f} ms"]]
    if native is not None:
        rows += [[f"weight bytes a native step reads ({manifest.target.native.layout})", f"{native / 1e6:.1f} MB"],
                 ["native floor at the numpy bandwidth", f"{(native + kv) / numpy_gbs / 1e6:.2f} ms"]]
    text = f"Bandwidth floor of {Path(bundle).name}'s target step\n\n" + tables.markdown(["quantity", "value"], rows)
    return text, {"weight_bytes": weights, "native_weight_bytes": native, "kv_bytes": kv,
                  "numpy_gbs": round(numpy_gbs, 2), "gemv_gbs": round(gemv_gbs, 2)}


# --- where the time goes, by op (onnxruntime) ----------------------------------------------------------------------

def profiled(backend, prefix: str) -> None:
    """Re-open an onnxruntime backend's session with the profiler on, on the same session options. This touches the
    backend's session and driver: the profiler is a session option, which specdec.load does not expose."""
    import onnxruntime as ort

    from specdec.lowering import lowering_for
    from specdec.runtime.backend import session_options

    options = session_options(backend.threads)
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    entry = backend.entry
    backend.session = ort.InferenceSession(str(backend.root / entry.onnx_path), options,
                                           providers=["CPUExecutionProvider"])
    backend.driver = lowering_for(entry.lowering).driver(backend.session, entry.dims, backend.max_seq_len,
                                                         entry.kv_dtype)
    backend.reset(1)


def node_minima(events: list, widths: tuple) -> dict:
    """{T: {op type: summed per-node minimum µs}} from a profile whose runs cycled through `widths`."""
    import bisect
    import collections

    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    times, ops = collections.defaultdict(list), {}
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        run = bisect.bisect_right(runs, event["ts"]) - 1
        node = event["name"][: -len("_kernel_time")]
        times[(widths[run % len(widths)], node)].append(event["dur"])
        ops[node] = event["args"].get("op_name", "?")
    out = {width: collections.Counter() for width in widths}
    for (width, node), durations in times.items():
        out[width][ops[node]] += min(durations)
    return out


def by_op(name: str, backend, widths: tuple, cache_len: int, rounds: int, top: int) -> str:
    import json
    import tempfile

    if backend.name != "onnxruntime":
        return f"**{name}**: --by-op needs the onnxruntime backend (this model runs on {backend.name})\n"
    with tempfile.TemporaryDirectory() as scratch:
        profiled(backend, str(Path(scratch) / "profile"))
        for _ in range(rounds):
            for width in widths:
                backend.forward(np.full((1, width), 7, np.int64), np.array([cache_len]))
        events = json.loads(Path(backend.session.end_profiling()).read_text())
    minima = node_minima(events, widths)
    order = sorted({op for counter in minima.values() for op in counter}, key=lambda op: -minima[widths[-1]][op])
    rows = [[op] + [f"{minima[w][op] / 1e3:.3f}" for w in widths] for op in order[:top]]
    rows.append(["**all nodes**"] + [f"{sum(minima[w].values()) / 1e3:.3f}" for w in widths])
    title = f"**{name}** at cache length {cache_len}: per-node minimum over {rounds} calls of each width, by op\n\n"
    return title + tables.markdown(["op"] + [f"T = {w} ms" for w in widths], rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--backends", default="auto", help="comma-separated: auto, onnxruntime, native")
    parser.add_argument("--roles", default="target,draft", help="comma-separated: target, draft, head")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="T@L items: T tokens at cache length L")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--floor", action="store_true", help="add the bandwidth floor of the first bundle's target, and "
                        "each target's step against the time to read its own bytes")
    parser.add_argument("--floor-gib", type=float, default=1.0)
    parser.add_argument("--floor-cache-len", type=int, default=64)
    parser.add_argument("--by-op", action="store_true", help="add onnxruntime's per-op profile")
    parser.add_argument("--pages", default=None, help="native only: private,shared (how its weights are held; "
                        "default: as SPECDEC_NATIVE_PAGES says, private unless set)")
    parser.add_argument("--isa", default=None, help="native only: avx2,avx512 (the kernels' instruction sets, each "
                        "a library of its own; default: as SPECDEC_NATIVE_ISA says, the widest the CPU has unless set)")
    parser.add_argument("--activations", default=None, help="native only: fp32,int8 (the target's activations, each "
                        "mode a model of its own in the same rounds; default: the bundle's)")
    parser.add_argument("--by-op-cache-len", type=int, default=200)
    parser.add_argument("--top", type=int, default=12, help="op types shown by --by-op")
    opening.add_common(parser, backend=False)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = parse_cases(args.cases)
    backends = [b for b in (part.strip() for part in args.backends.split(",")) if b]
    unknown = [b for b in backends if b not in ("auto", "onnxruntime", "native")]
    if unknown or not backends:
        raise SystemExit(f"unknown backend in {args.backends!r}; choose from auto, onnxruntime, native")
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if any(r not in ROLES for r in roles):
        raise SystemExit(f"unknown role in {args.roles!r}; choose from {', '.join(ROLES)}")
    pages = [p.strip() for p in args.pages.split(",") if p.strip()] if args.pages else [None]
    if any(p not in PAGES for p in pages if p is not None):
        raise SystemExit(f"unknown pages in {args.pages!r}; choose from {', '.join(PAGES)}")
    isas = [i.strip() for i in args.isa.split(",") if i.strip()] if args.isa else [None]
    if any(i not in ISAS for i in isas if i is not None):
        raise SystemExit(f"unknown instruction set in {args.isa!r}; choose from {', '.join(ISAS)}")
    modes = [a.strip() for a in args.activations.split(",") if a.strip()] if args.activations else [None]
    if any(m not in ACTIVATIONS for m in modes if m is not None):
        raise SystemExit(f"unknown activations in {args.activations!r}; choose from {', '.join(ACTIVATIONS)}")
    with contextlib.ExitStack() as stack:
        models, settings, sources = open_all(stack, args.bundles, backends, roles, args.threads, pages, isas, modes)
        if not models:
            raise SystemExit(f"no model with a role in {roles!r} in {args.bundles}")
        run = record.run_record(EXPERIMENT, settings, args.threads, __file__, argv,
                                cases=[list(c) for c in cases], rounds=args.rounds)
        extra, readers, floor_case = {}, {}, (1, args.floor_cache_len)
        if args.floor:
            manifest = next(iter(models.values()))[1]
            for name, (model, entry) in models.items():  # a reader of each target's own bytes, in the same rounds
                if name.endswith(" target"):
                    nbytes = sum(floor_step_bytes(sources[name], entry.target, args.floor_cache_len))
                    reader = Reader(nbytes, step_arrays(model))  # its own weights' pages, where they are native
                    readers[name] = f"read {name}'s {reader.nbytes / 1e6:.1f} MB"
                    extra[readers[name]] = stack.enter_context(contextlib.closing(reader))
            cases = cases if floor_case in cases else cases + [floor_case]
        samples = measure(models, cases, args.rounds, extra)
        spreads = {key: timer.summarize(values) for key, values in samples.items() if key not in extra}
        text = step_table(models, cases, spreads)
        finished = {}
        heads, ratios = head_table(samples, models, cases)
        if ratios:
            text += heads
            finished["head"] = ratios
        if args.floor:
            floor, finished["floor"] = floor_table(Path(args.bundles[0]), manifest, args.floor_cache_len,
                                                   args.floor_gib, args.rounds)
            paired, finished["floor"]["paired"] = paired_floor(samples, models, floor_case, readers)
            reads = {name: timer.summarize(samples[name]) for name in dict.fromkeys(readers.values())}
            finished["floor"]["read_ms"] = {name: {"min": round(read.min * 1e3, 3), "median": round(
                read.median * 1e3, 3)} for name, read in reads.items()}
            threads = next(iter(extra.values())).cores
            text += ("\n" + floor + f"\nPaired by round: each target's {label(floor_case, 0)} over the time to read "
                     f"its own step's bytes (the native weights where it has them, and the KV; {threads} threads) in "
                     "the same round. Reads (min / median ms): "
                     + "; ".join(f"{name} {read.ms(2)}" for name, read in reads.items()) + "\n\n" + paired)
        if args.by_op:
            for name, (model, manifest) in models.items():
                widths = tuple(sorted({1} | {t for t, _ in cases if 1 < t <= manifest.defaults.gamma_max + 1}))
                text += "\n" + by_op(name, model, widths, min(args.by_op_cache_len, model.max_seq_len - max(widths)),
                                     args.rounds, args.top)
    record.finish(run, args.out, {"step.md": text, "steps.csv": csv_rows(spreads, models)}, shown=text, **finished)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
