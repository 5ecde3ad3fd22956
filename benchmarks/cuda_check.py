"""The cuda backend's device check, in one run on a GPU machine (make gpu-check; docs/backends.md):

1. environment: GPU, driver, CUDA runtime, CuPy, torch;
2. kernels: every kernel of kernels.cu against its numpy reference on the same inputs (SmolLM2-135M's shapes);
3. exactness: on the tiny bundles of --bundles, greedy output of every drafter identical to plain decoding on the
   cuda backend and to onnxruntime's on the CPU; sampled tokens' χ² test at draft positions 0-2;
4. parity: teacher-forced logits against the CPU native engine on the same weights (the tiny bundles, and a
   same-shape random twin of SmolLM2-135M in bf16): max |Δ logit| / max |logit| and argmax agreement;
5. latency on the twin: a decode step with graphs and with every kernel launched one by one, verify passes of
   T = 2 .. γ_max + 1, the int4-q41 draft's step, host time per speculative round, the GPU memory held; the speedup
   the formula predicts from an acceptance rate measured on the CPU with the real weights (--alpha);
6. peer on the same GPU: Hugging Face transformers' generate() on the twin (same config and random weights, bf16),
   plain with its dynamic and static caches, and assisted generation with the model as its own assistant (HF's best
   case: every draft accepted).

Latency does not depend on the weights' values, so the twin measures it; acceptance needs the real weights, which do
not fit a device call here: the predicted speedup says so. --dry-run runs it all on this CPU with the numpy
references standing in for the GPU (small shapes): it checks the script, never the GPU.

Usage: python benchmarks/cuda_check.py --out DIR [--bundles DIR] [--alpha 0.96] [--dry-run]
Writes DIR/record.json and DIR/summary.md; exit code 1 if a check failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.record import finish, run_record, write_record  # noqa: E402
from benchmarks.harness.timer import interleave, summarize, timed  # noqa: E402
from specdec.blocks import encode, q8_blocks, q41_blocks, q41_pairs, rows_of  # noqa: E402
from specdec.cuda.layouts import SERVED  # noqa: E402
from specdec.manifest import ModelDims  # noqa: E402
from specdec.native.weights import DraftWeights, Layer, NativeWeights  # noqa: E402

KERNEL_TOLERANCE = 1e-4  # of the largest |value|: fp32 in another summation order
PARITY_TOLERANCE = 1e-3  # of the largest |logit|, teacher forced over 64 positions
SMOLLM2 = dict(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, mlp=1536, vocab=49152, positions=2048)
SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=320, positions=256)
PROMPTS = ["The quick brown fox", "Once upon a time", "def fib(n):", "1, 2, 3, 4,", "Summarize: the cat sat",
           "Hello, my name is", "In the beginning", "import numpy as np", "Q: What is 2 + 2? A:", "a b a b a b",
           "The capital of France is", "for i in range(10):", "Dear Sir,", "Rain, rain,", "The weather today",
           "SELECT * FROM", "x = [1, 2", "It was the best of times", "The quick brown fox jumps", "once more"]


# ---- the twin: SmolLM2-135M's shapes, seeded random weights --------------------------------------------------------
def twin_dims(shape: dict) -> ModelDims:
    return ModelDims("llama", shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["hidden"],
                     shape["vocab"], shape["positions"])


def twin_weights(shape: dict, seed: int = 0) -> tuple[NativeWeights, DraftWeights]:
    """bf16 rows of a random LLaMA of `shape` (tied head) and its int4-q41 draft (the same weights on Q4_1 grids, in
    pairs; the head on Q8_0); made once per shape."""
    key = (tuple(sorted(shape.items())), seed)
    if key not in _TWINS:
        _TWINS[key] = _make_twin(shape, seed)
    return _TWINS[key]


_TWINS = {}


def _make_twin(shape: dict, seed: int) -> tuple[NativeWeights, DraftWeights]:
    rng = np.random.default_rng(seed)
    H, D, I = shape["hidden"], shape["head_dim"], shape["mlp"]
    sizes = {"qkv": ((shape["heads"] + 2 * shape["kv_heads"]) * D, H), "o": (H, shape["heads"] * D),
             "gate_up": (2 * I, H), "down": (H, I)}

    def bf16(n, k, std=0.02):
        return (rng.normal(0, std, (n, k)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)

    layers, pairs = [], []
    for _ in range(shape["layers"]):
        linear = {name: bf16(*size) for name, size in sizes.items()}
        norm = np.ones(H, np.float32)
        layers.append(Layer(norm, norm, *(rows_of(linear[name], "bf16") for name in sizes)))
        pairs.append([q41_pairs(q41_blocks(linear[name])[0]) for name in sizes])
    head = bf16(shape["vocab"], H, 0.05)
    half = D // 2
    inv = 1.0 / (100000.0 ** (np.arange(half, dtype=np.float64) / half))
    angles = np.arange(shape["positions"])[:, None] * inv[None]
    weights = NativeWeights(None, layers, np.ones(H, np.float32), rows_of(head, "bf16"),
                            np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), 1e-5, D ** -0.5,
                            "bf16")
    return weights, DraftWeights(pairs, q8_blocks(head)[0], None, 0.0)


# ---- 2. kernels against their references ---------------------------------------------------------------------------
def kernel_parity(device, reference, shape: dict) -> dict:
    """{case: max |device − reference| / max |reference|} over every kernel and layout."""
    rng = np.random.default_rng(1)
    H, D, heads, kv_heads, I, S = (shape[k] for k in ("hidden", "head_dim", "heads", "kv_heads", "mlp", "positions"))
    errors = {}

    def compare(name, build):
        outs = []
        for k in (device, reference):
            run, out = build(k)
            run()
            k.synchronize()
            parts = out if isinstance(out, tuple) else (out,)
            outs.append(np.concatenate([np.asarray(k.fetch(a), dtype=np.float64).ravel() for a in parts]))
        got, want = outs
        both = np.isnan(got) & np.isnan(want)  # the same answer: argmax's mark of a row with no distribution
        diff = np.nan_to_num(np.where(both, 0.0, np.abs(got - want)), nan=np.inf)  # NaN on one side alone: a miss
        errors[name] = float(diff.max() / max(float(np.nanmax(np.abs(want), initial=0.0)), 1e-30))

    w = rng.normal(0, 0.05, (3 * H, H)).astype(np.float32)
    layouts = {kind.label: encode(kind, w) for kind in SERVED}  # every weight kind the cuda kernels serve
    for rows in (1, 5, 40, 2 * device.few_rows):  # the last: cuBLAS's path
        x = rng.normal(0, 1, (rows, H)).astype(np.float32)
        for name, array in layouts.items():
            compare(f"linear {name} M={rows}", lambda k, a=array, x=x: _linear_case(k, a, x, H))
    xs = rng.normal(0, 1, (7, H)).astype(np.float32)
    gamma = rng.normal(1, 0.1, H).astype(np.float32)
    gate_up = rng.normal(0, 1, (7, 2 * H)).astype(np.float32)
    for rows in (1, 5, 2 * device.few_rows):
        for name in layouts:
            x = rng.normal(0, 1, (rows, H)).astype(np.float32)
            compare(f"linear_norm {name} M={rows}", lambda k, a=layouts[name], x=x: _norm_case(k, a, x, gamma))
            gu = np.resize(gate_up, (rows, 2 * H))
            compare(f"linear_silu {name} M={rows}", lambda k, a=layouts[name], g=gu: _silu_linear_case(k, a, g))
    compare("rmsnorm", lambda k: _rmsnorm_case(k, xs, gamma, 7))
    compare("rmsnorm last-only", lambda k: _rmsnorm_case(k, xs[:6], gamma, 2, 3, 2))
    gu = rng.normal(0, 2, (5, 2 * I)).astype(np.float32)
    compare("silu_mul", lambda k: _silu_case(k, gu))
    compare("copy_rows", lambda k: _copy_rows_case(k, xs))
    table = rows_of(rng.normal(0, 1, (50, H)).astype(np.float32), "bf16")
    compare("embed bf16", lambda k: _embed_case(k, table, np.array([3, 49, 0, 7], np.int32), H))
    compare("embed q80", lambda k: _embed_case(k, q8_blocks(w[:50])[0], np.array([3, 49, 0, 7], np.int32), H))
    logits = rng.normal(0, 3, (4, shape["vocab"])).astype(np.float32)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # equal maxima: the first wins
    compare("argmax", lambda k: _argmax_case(k, logits))
    unsound = logits.copy()
    unsound[0, 7], unsound[1, 3], unsound[2], unsound[3, 11] = np.nan, np.inf, -np.inf, -np.inf  # the last: sound
    compare("argmax's mark of unsound rows", lambda k: _argmax_case(k, unsound, best_only=True))
    for steps, pos in ((1, [S - 1, 0]), (5, [S // 2, 7]), (8, [S - 8, S // 4])):
        compare(f"attention T={steps}", lambda k, t=steps, p=pos: _attention_case(k, rng_for(t), t, p, heads,
                                                                                 kv_heads, D, S))
        compare(f"rope_kv T={steps}", lambda k, t=steps, p=pos: _rope_case(k, rng_for(t), t, p, heads, kv_heads,
                                                                          D, S))
    return errors


def rng_for(seed: int):
    return np.random.default_rng(100 + seed)


def _norm_case(k, array, x, gamma):
    w, xd, g, out = k.weight(array, x.shape[1]), k.upload(x), k.upload(gamma), k.empty((len(x), len(array)), np.float32)
    return (lambda: k.linear_norm(xd, g, 1e-5, w, out)), out


def _silu_linear_case(k, array, gu):
    w, x, out = k.weight(array, gu.shape[1] // 2), k.upload(gu), k.empty((len(gu), len(array)), np.float32)
    return (lambda: k.linear_silu(x, w, out)), out


def _rmsnorm_case(k, x, gamma, rows, step=1, offset=0):
    xd, g, out = k.upload(x), k.upload(gamma), k.empty((rows, x.shape[1]), np.float32)
    return (lambda: k.rmsnorm(xd, g, 1e-5, out, step, offset)), out


def _copy_rows_case(k, x):
    # x [R, H] into column 1 of features [R, 3, H] (a forward's hidden states of one layer)
    xd, out = k.upload(x), k.empty((len(x), 3, x.shape[1]), np.float32)
    return (lambda: k.copy_rows(out[:, 1], xd)), out


def _silu_case(k, gu):
    x, out = k.upload(gu), k.empty((len(gu), gu.shape[1] // 2), np.float32)
    return (lambda: k.silu_mul(x, out)), out


def _linear_case(k, array, x, inputs):
    w, xd, out = k.weight(array, inputs), k.upload(x), k.empty((len(x), len(array)), np.float32)
    return (lambda: k.linear(xd, w, out)), out


def _embed_case(k, table, ids, width):
    t, i, out = k.weight(table, width), k.upload(ids), k.empty((len(ids), width), np.float32)
    return (lambda: k.embed(t, i, out)), out


def _argmax_case(k, logits, best_only: bool = False):
    """argmax's ids and best logits (as int32 bits), or its best logits alone as floats (NaN: a row not sound, whose
    ids mean nothing)."""
    result = k.empty(2 * len(logits), np.int32)
    x = k.upload(logits)
    best = result[len(logits) :].view(np.float32)
    return (lambda: k.argmax(x, result[: len(logits)], best)), best if best_only else result


def _attention_case(k, rng, steps, pos, heads, kv_heads, dim, size):
    keys, values = rng.normal(0, 1, (2, 3, kv_heads, size, dim)).astype(np.float32)
    q = rng.normal(0, 1, (2 * steps, heads, dim)).astype(np.float32)
    args = [k.upload(a) for a in (q, keys, values, np.array(pos, np.int32), np.array([2, 0], np.int32))]
    out = k.empty(q.shape, np.float32)
    return (lambda: k.attention(*args, steps, dim ** -0.5, out)), out


def _rope_case(k, rng, steps, pos, heads, kv_heads, dim, size):
    keys = k.upload(np.zeros((3, kv_heads, size, dim), np.float32))
    values = k.upload(np.zeros((3, kv_heads, size, dim), np.float32))
    qkv = k.upload(rng.normal(0, 1, (2 * steps, (heads + 2 * kv_heads) * dim)).astype(np.float32))
    cos, sin = (k.upload(rng.normal(0, 1, (size, dim // 2)).astype(np.float32)) for _ in range(2))
    q = k.empty((2 * steps, heads, dim), np.float32)
    pos, slots = k.upload(np.array(pos, np.int32)), k.upload(np.array([2, 0], np.int32))
    return (lambda: k.rope_kv(qkv, cos, sin, pos, slots, steps, heads, kv_heads, q, keys, values)), (q, keys, values)


# ---- 3. exactness and 4. parity on the tiny bundles ---------------------------------------------------------------
def exactness(bundle: Path, options, new_tokens: int) -> dict:
    from specdec.runtime import GenerationConfig, load
    from specdec.runtime.generator import load_cuda

    with load_cuda(bundle, options) as gen:
        plain = {p: gen.generate(p, GenerationConfig(max_new_tokens=new_tokens, drafter="none")).token_ids
                 for p in PROMPTS}
        report = {"prompts": len(PROMPTS), "new_tokens": new_tokens, "graphs": gen.target.backend.graphs.captures}
        for drafter in ("prompt_lookup", "model", "auto"):
            same, accepted = 0, []
            for prompt in PROMPTS:
                got = gen.generate(prompt, GenerationConfig(max_new_tokens=new_tokens, drafter=drafter, gamma=4))
                same += got.token_ids == plain[prompt]
                accepted.append(got.stats.acceptance_rate)
            report[drafter] = {"identical": same, "acceptance": float(np.mean(accepted))}
    with load(bundle, backend="onnxruntime") as ort:
        report["onnxruntime_identical"] = sum(
            ort.generate(p, GenerationConfig(max_new_tokens=new_tokens, drafter="none")).token_ids == plain[p]
            for p in PROMPTS)
    return report


def distribution(bundle: Path, options) -> dict:
    from specdec.runtime import GenerationConfig
    from specdec.runtime.generator import load_cuda
    from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, TOP_K, exact_joint, p_value, sampled

    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", eos_token_ids=(), **TOP_K)
    with load_cuda(bundle, options) as gen:
        prompt_ids = gen.codec.encode(PROMPT)
        counts, (proposed, accepted) = sampled(gen, prompt_ids, config)
        return {"p_value": p_value(exact_joint(gen, prompt_ids, config), counts), "proposed": proposed,
                "accepted": accepted}


def bundle_parity(bundle: Path, options, positions: int) -> dict:
    """Teacher forced: each prompt's tokens and then random ids, fed whole to both engines; every position's logits."""
    from specdec.manifest import read_manifest
    from specdec.runtime.cuda_backend import CudaBackend
    from specdec.runtime.native_backend import NativeBackend

    manifest = read_manifest(bundle)
    with CudaBackend(bundle, manifest.target, options) as cuda, NativeBackend(bundle, manifest.target) as native:
        ids = np.random.default_rng(2).integers(3, cuda.vocab_size, (len(PROMPTS), positions))
        found = _teacher_forced(lambda t, p: cuda.forward(t, p), lambda t, p: native.forward(t, p),
                                (cuda.reset, native.reset), ids)
        return {**found, "features_max_rel_diff": _features_parity(cuda, native, ids[0])}


def _features_parity(cuda, native, row) -> float:
    """max |cuda − native| / max |native| of the hidden states a trained head reads, every position of one row."""
    from specdec.runtime.forward import ForwardRequest, head_feature_layers

    layers = head_feature_layers(native.entry.dims.num_layers)
    request = ForwardRequest(row[None], np.zeros(1, np.int64), last_only=True, feature_layers=layers)
    found = []
    for backend in (cuda, native):
        backend.reset(1)
        found.append(backend.run(request).features)
    return float(np.abs(found[0] - found[1]).max() / np.abs(found[1]).max())


def _teacher_forced(first, second, resets, ids) -> dict:
    worst, agree, total, near = 0.0, 0, 0, 0
    for row in ids:
        for reset in resets:
            reset(1)
        tokens = row[None]
        a = np.asarray(first(tokens, np.zeros(1, np.int64)))[0]
        b = np.asarray(second(tokens, np.zeros(1, np.int64)))[0]
        scale = np.abs(b).max()
        worst = max(worst, float(np.abs(a - b).max() / scale))
        same = a.argmax(-1) == b.argmax(-1)
        top = np.sort(b, axis=-1)[:, -2:]
        near += int(((~same) & (top[:, 1] - top[:, 0] <= PARITY_TOLERANCE * scale)).sum())
        agree, total = agree + int(same.sum()), total + len(same)
    return {"max_rel_diff": worst, "argmax_agree": agree / total, "positions": total,
            "disagreements_within_tolerance": near, "disagreements": total - agree}


# ---- 5. latency on the twin -----------------------------------------------------------------------------------------
def twin_latency(kernels, shape: dict, gamma_max: int, rounds: int, alpha: float | None, eager_kernels) -> dict:
    from specdec.cuda.model import CudaModel

    weights, draft = twin_weights(shape)
    dims = twin_dims(shape)
    size = shape["positions"]
    rows = gamma_max + 1

    def models(k, graphs, fused=True):
        target = CudaModel(k, weights, dims, size, 1, rows, graphs=graphs, fused=fused).open()
        target.reset(1)
        drafted = CudaModel(k, weights, dims, size, 1, rows, draft=draft, kv_owner=target, graphs=graphs).open(target)
        return target, drafted

    free_before = kernels.free_bytes()
    target, drafted = models(kernels, True)
    eager, _ = models(eager_kernels, False)
    unfused, _ = models(kernels, True, fused=False)
    context = min(512, size // 2)
    prompt = np.random.default_rng(3).integers(0, shape["vocab"], (1, context))
    for model in (target, eager, unfused):
        model.forward(prompt, np.zeros(1, np.int64), np.zeros(1, np.int64), True)
    at = np.array([context])
    one = np.array([[11]])
    cases = {"step": lambda: target.forward(one, at, np.zeros(1, np.int64), True),
             "step eager": lambda: eager.forward(one, at, np.zeros(1, np.int64), True),
             "step unfused": lambda: unfused.forward(one, at, np.zeros(1, np.int64), True),
             "draft step": lambda: drafted.forward(one, at, np.zeros(1, np.int64), True),
             "draft chain of 4": lambda: drafted.chain(np.array([11]), at, np.zeros(1, np.int64), 4)}
    for gamma in range(1, gamma_max + 1):
        block = np.full((1, gamma + 1), 11)
        cases[f"verify T={gamma + 1}"] = lambda b=block: target.forward(b, at, np.zeros(1, np.int64), False)
    times = {name: summarize(s) for name, s in interleave(cases, rounds, warmup=3).items()}
    step = times["step"].min
    held = None if free_before is None else free_before - kernels.free_bytes()
    report = {"seconds": {name: {"min": t.min, "median": t.median} for name, t in times.items()},
              "graphs_speedup": times["step eager"].min / step,
              "fusion_speedup": times["step unfused"].min / step,
              "c": times["draft step"].min / step,
              "c_chained": times["draft chain of 4"].min / 4 / step,
              "r": {g: times[f"verify T={g + 1}"].min / step for g in range(1, gamma_max + 1)},
              "memory_bytes": {"weights": target.weight_bytes() + drafted.weight_bytes(),
                               "kv": target.kv_bytes(1), "workspace": target.workspace_bytes(rows) * 2,
                               "device_total_held": held}}
    if alpha is not None:
        report["predicted"] = predicted_speedup(alpha, min(report["c"], report["c_chained"]), report["r"])
    return report


def predicted_speedup(alpha: float, c: float, r: dict) -> dict:
    """The paper's expected speedup with a measured verify cost: (1 − α^(γ+1)) / ((1 − α)(γc + r(γ)))."""
    best = max(r, key=lambda g: (1 - alpha ** (g + 1)) / ((1 - alpha) * (g * c + r[g])))
    value = (1 - alpha ** (best + 1)) / ((1 - alpha) * (best * c + r[best]))
    return {"alpha": alpha, "gamma": best, "speedup": value}


def host_per_round(bundle: Path, options, new_tokens: int) -> dict:
    """Host time (outside forward calls) per speculative round, on a tiny bundle's model drafter."""
    from specdec.runtime import GenerationConfig
    from specdec.runtime.generator import load_cuda

    with load_cuda(bundle, options) as gen:
        gen.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8, drafter="model"))
        result = gen.generate(PROMPTS[0], GenerationConfig(max_new_tokens=new_tokens, drafter="model", gamma=4))
        stats = result.stats
        return {"host_s_per_round": stats.host_s / max(stats.verify_passes, 1), "rounds": stats.verify_passes,
                "forward_s_per_round": stats.forward_s / max(stats.verify_passes, 1)}


# ---- 6. the peer: Hugging Face transformers on the same GPU --------------------------------------------------------
def hf_peer(shape: dict, device: str, new_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                         max_position_embeddings=shape["positions"], tie_word_embeddings=True)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, shape["vocab"], (1, 32), device=device)
    modes = {"plain": {}, "static cache": {"cache_implementation": "static"},
             "assisted (itself)": {"assistant_model": model}}

    def clock() -> float:  # the device's queued work done first, so a call's time is its device time too
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    report = {}
    for name, extra in modes.items():
        def run(tokens, extra=extra):
            with torch.no_grad():
                return timed(lambda: model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens,
                                                    do_sample=False, **extra), clock)[1]
        try:
            run(1), run(new_tokens)  # warm-up of both lengths (a static cache compiles its forward for each)
            per_token = [(run(new_tokens) - run(1)) / (new_tokens - 1) for _ in range(repeats)]
            report[name] = {"s_per_token_min": min(per_token), "s_per_token_median": float(np.median(per_token))}
        except Exception as exc:  # noqa: BLE001 - a mode this transformers version refuses: recorded, not fatal
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    report["settings"] = {"dtype": str(dtype), "attention": model.config._attn_implementation,
                          "new_tokens": new_tokens, "prompt": 32, "greedy": True,
                          "torch_threads": torch.get_num_threads(),
                          "static cache": "transformers compiles the forward itself for a static cache on CUDA (its "
                                          "documented fast path); on a CPU it does not",
                          "measure": "(time of new_tokens - time of 1) / (new_tokens - 1), min of repeats"}
    return report


# ---- the run ---------------------------------------------------------------------------------------------------------
def environment(kernels) -> dict:
    info = {"kernels": kernels.name}
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        info.update(gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                    capability=kernels.capability, memory=int(props["totalGlobalMem"]),
                    driver=cupy.cuda.runtime.driverGetVersion(), runtime=cupy.cuda.runtime.runtimeGetVersion(),
                    cupy=cupy.__version__)
    except Exception as exc:  # noqa: BLE001 - the dry run has no CuPy
        info["cupy"] = f"unavailable: {exc}"
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--bundles", default=".gpu/bundles", help="folder of tiny bundles with native weights "
                        "(make gpu-bundles writes them)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="acceptance rate of the int4-q41 draft on the real weights, measured on the CPU")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip", default="", help="comma-separated sections to skip (kernels, exactness, "
                        "distribution, parity, latency, host, peer)")
    parser.add_argument("--dry-run", action="store_true", help="the numpy references stand in for the GPU (CPU)")
    parser.add_argument("--commit", default=None, help="the commit the tree is at, where it has no git history")
    args = parser.parse_args(argv)
    from specdec.cuda.reference import ReferenceKernels
    from specdec.runtime.cuda_backend import CudaOptions

    shape = SMALL if args.dry_run else SMOLLM2
    if args.dry_run:
        kernels, eager_kernels = ReferenceKernels(16), ReferenceKernels(16)
        options = CudaOptions(kernels=ReferenceKernels)
    else:
        from specdec.cuda.device import CupyKernels

        kernels, options = CupyKernels(0, few_rows=16), CudaOptions()
        eager_kernels = kernels
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = run_record("cuda_check", {"specdec cuda": {"graphs": True, "kernels": kernels.name},
                                       "transformers": {"dtype": "bfloat16", "modes": "plain, static cache, assisted"}},
                        None, __file__, argv)
    record["environment"] = environment(kernels)
    if args.commit and not record["git"]["commit"]:
        record["git"] = {"commit": args.commit, "short": args.commit[:7], "dirty": None}
    bundles = sorted(p for p in Path(args.bundles).glob("*") if (p / "manifest.json").exists())
    skip = set(filter(None, args.skip.split(",")))
    sections = {
        "kernels": lambda: kernel_parity(kernels, ReferenceKernels(16), shape),
        "exactness": lambda: {b.name: exactness(b, options, args.new_tokens) for b in bundles},
        "distribution": lambda: {b.name: distribution(b, options) for b in bundles[:1]},
        "parity": lambda: {**{b.name: bundle_parity(b, options, args.new_tokens) for b in bundles},
                           "twin": twin_parity(kernels, shape, args.new_tokens)},
        "latency": lambda: twin_latency(kernels, shape, 7, args.rounds, args.alpha, eager_kernels),
        "host": lambda: {b.name: host_per_round(b, options, args.new_tokens) for b in bundles[:1]},
        "peer": lambda: hf_peer(shape, "cpu" if args.dry_run else "cuda", args.new_tokens, 3),
    }
    results, failed = {}, []
    for name, section in sections.items():
        if name in skip:
            continue
        started = time.perf_counter()
        try:
            results[name] = section()
        except Exception:  # noqa: BLE001 - one section's failure is recorded; the others still run
            results[name] = {"error": traceback.format_exc()}
            failed.append(name)
        results[name + "_seconds"] = round(time.perf_counter() - started, 1)
        print(f"== {name}: {results[name + '_seconds']} s", flush=True)
        write_record(out, record, results=results, failed=failed)  # what a timed-out run still leaves
    failed += verdicts(results)
    text = summary(results, failed)
    finish(record, out, {"summary.md": text}, shown=text, results=results, failed=failed)
    return 1 if failed else 0


def twin_parity(kernels, shape: dict, positions: int) -> dict:
    """The twin's bf16 target on the cuda kernels against the CPU native engine, teacher forced."""
    from specdec.cuda.model import CudaModel
    from specdec.native.build import load_kernels
    from specdec.native.model import NativeModel

    from specdec.runtime.backend import default_threads

    weights, _ = twin_weights(shape)
    dims, size = twin_dims(shape), shape["positions"]
    cuda = CudaModel(kernels, weights, dims, size, 1, 8).open()
    native = NativeModel(weights, dims, load_kernels(), size, threads=default_threads())
    ids = np.random.default_rng(4).integers(0, shape["vocab"], (4, positions))
    slot = np.zeros(1, np.int64)
    return _teacher_forced(lambda t, p: cuda.forward(t, p, slot, False),
                           lambda t, p: native.forward(t, p, slot, False), (cuda.reset, native.reset), ids)


def verdicts(results: dict) -> list:
    """The checks that failed their bound."""
    bad = []
    kernels = results.get("kernels", {})
    if isinstance(kernels, dict) and any(isinstance(v, float) and v > KERNEL_TOLERANCE for v in kernels.values()):
        bad.append("kernels: a kernel differs from its reference past the tolerance")
    for name, report in (results.get("exactness") or {}).items():
        if isinstance(report, dict) and "prompts" in report:
            if any(report[d]["identical"] != report["prompts"] for d in ("prompt_lookup", "model", "auto")) or \
                    report["onnxruntime_identical"] != report["prompts"]:
                bad.append(f"exactness: {name}")
    for name, report in (results.get("parity") or {}).items():
        if isinstance(report, dict) and "max_rel_diff" in report and (
                report["max_rel_diff"] > PARITY_TOLERANCE or report["argmax_agree"] < 0.99
                or report["disagreements"] != report["disagreements_within_tolerance"]
                or report.get("features_max_rel_diff", 0.0) > PARITY_TOLERANCE):
            bad.append(f"parity: {name}")
    for name, report in (results.get("distribution") or {}).items():
        if isinstance(report, dict) and report.get("p_value", 1.0) <= 1e-3:
            bad.append(f"distribution: {name}")
    return bad


def summary(results: dict, failed: list) -> str:
    lines = ["# cuda device check", "", f"failed: {', '.join(failed) or 'none'}", ""]
    latency = results.get("latency", {})
    if "seconds" in latency:
        lines += ["| case | min ms | median ms |", "|---|---|---|"]
        lines += [f"| {name} | {t['min'] * 1e3:.3f} | {t['median'] * 1e3:.3f} |"
                  for name, t in latency["seconds"].items()]
        lines += ["", f"graphs vs eager: {latency['graphs_speedup']:.2f}x; fused vs unfused: "
                      f"{latency['fusion_speedup']:.2f}x; draft/target c = {latency['c']:.3f} a step, "
                      f"{latency['c_chained']:.3f} a step of a chain of 4"]
        if "predicted" in latency:
            p = latency["predicted"]
            lines.append(f"predicted speedup at α={p['alpha']}: {p['speedup']:.2f}x (γ={p['gamma']})")
    peer = {name: r["s_per_token_min"] for name, r in results.get("peer", {}).items()
            if isinstance(r, dict) and "s_per_token_min" in r}
    for name, seconds in peer.items():
        lines.append(f"transformers {name}: {seconds * 1e3:.3f} ms/token (min)")
    if peer and "seconds" in latency:
        ours = latency["seconds"]["step"]["min"] / latency.get("predicted", {}).get("speedup", 1.0)
        lines.append(f"specdec's best ({'predicted' if 'predicted' in latency else 'plain'}) {ours * 1e3:.3f} "
                     f"ms/token: {min(peer.values()) / ours:.1f}x transformers' best")
    lines.append("")
    lines.append("```json\n" + json.dumps({k: v for k, v in results.items() if k != "latency"}, indent=1,
                                          default=str)[:20000] + "\n```")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
