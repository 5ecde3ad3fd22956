"""An INT4 draft that keeps a Q4_1 model's float block minimum (docs/calibration.md).

A GGUF Q4_1 weight block is w = d·q + m (32 values along K, float scale d and float minimum m, q in 0..15).
MatMulNBits dequantizes (q − zp)·d with an integer zp, which moves each block by up to half a step. Here every
block keeps its exact codes and scale; zp is the nearest integer to −m/d, and the rest of the minimum,
r = m + zp·d (|r| ≤ d/2 for a block whose −m/d lies in 0..15), is added back through the activation block sums:

    x @ W = MatMulNBits(x; q, d, zp) + blocksum(x) @ r,    blocksum(x)[.., b] = sum of x[.., 32b : 32b + 32]

Two ways to add it (`minimum`):
- "rows" (default): the block sums go after x as K/32 more inputs of the same MatMulNBits, whose extra rows hold r
  in 4 bits (symmetric, one scale per 32 rows of a column): x_aug = Concat(x, blocksum(x)), one kernel per weight.
  r is then held to within max|r| / 14 of its column's extra block; the codes and scales of W stay exact. It is the
  default because the draft's step is cheaper, by fewer nodes, at a small cost in top-1 agreement; a bundle of each
  measures it: `python benchmarks/step.py EXACT ROWS --roles draft`, `python benchmarks/draft_quality.py EXACT ROWS`
  and `python benchmarks/modes.py EXACT ROWS --modes none,model:4,model:8` (records in benchmarks/results/q41-rows/).
- "exact": a small fp32 MatMul blocksum(x) @ r and an Add after MatMulNBits: the weights bit for bit, 2 more
  nodes per weight.

The block sum is a Reshape + ReduceSum shared by all MatMuls of one input (x: [B, T, K], rank 3 in our graphs).
Weights that are not on a Q4_1 grid still quantize (with a float-min correction, like RTN plus a better minimum).
The LM head (a Gemm over the tied embedding, which the GGUF stores as Q8_0) becomes 8-bit MatMulNBits on the Q8_0
grid: exact for SmolLM2, and faster than the fp32 Gemm at T = 1 (`python benchmarks/step.py BUNDLE --roles draft
--by-op` shows each op's share).
"""
from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path

import numpy as np

from specdec.blocks import q8_0_from_weight, q41_from_weight  # noqa: F401 (also this module's API)
from specdec.errors import missing_dependency

log = logging.getLogger(__name__)

BLOCK = 32
ACCURACY_LEVEL = 4  # int8 compute in MatMulNBits: the fast path on x86 CPUs
GRID_TOLERANCE = 1e-3  # max |w − dequant| / d for a block to count as on the grid


class Minimum(StrEnum):
    """How the float minimum's residual is added back (module docstring)."""

    ROWS = "rows"
    EXACT = "exact"


MINIMUMS = tuple(minimum.value for minimum in Minimum)  # plain strings: argparse and messages print them


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    # values: [..., 2m] uint8 in 0..15 -> [..., m] uint8, element 2i in the low nibble
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def matmulnbits_tensors(q: dict) -> tuple:
    """MatMulNBits inputs: B [N, nb, 16] uint8, scales [N, nb] f32, zero_points [N, ceil(nb/2)] uint8."""
    codes = q["codes"].transpose(2, 0, 1)  # [N, nb, 32]
    packed = _pack_nibbles(codes)  # [N, nb, 16]
    zero_point = q["zero_point"].T  # [N, nb]
    if zero_point.shape[1] % 2:
        zero_point = np.concatenate([zero_point, np.zeros_like(zero_point[:, :1])], axis=1)
    return packed, np.ascontiguousarray(q["scale"].T), _pack_nibbles(zero_point)


def residual_rows(residual: np.ndarray, step: np.ndarray) -> tuple:
    """The residuals r [nb, N] as MatMulNBits rows: 4-bit symmetric codes (zp 8) with one scale per 32 rows of a
    column, the rows past nb zero. step: the blocks' d [nb, N]. -> (codes [ext, 32, N] uint8, scale [ext, N],
    zero_point [ext, N], max |r − dequant| / d: the minimum's error in steps of its own block, as grid_error)."""
    nb, n = residual.shape
    ext = -(-nb // BLOCK)
    padded = np.zeros((ext * BLOCK, n), np.float32)
    padded[:nb] = residual
    blocks = padded.reshape(ext, BLOCK, n)
    amax = np.abs(blocks).max(axis=1)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(blocks / scale[:, None]), -8, 7)
    error = np.abs(codes * scale[:, None] - blocks).reshape(ext * BLOCK, n)[:nb] / step
    return (codes + 8).astype(np.uint8), scale, np.full((ext, n), 8, np.uint8), float(error.max())


def _block_sums(x: str, k: int, base: str, add_init, helper) -> tuple:
    """(nodes, name) of blocksum(x): [B, T, K] -> [B, T, nb, 32] -> [B, T, nb]."""
    add_init(f"{base}_blockshape", np.array([0, 0, k // BLOCK, BLOCK], np.int64))
    add_init(f"{base}_lastaxis", np.array([-1], np.int64))
    return [helper.make_node("Reshape", [x, f"{base}_blockshape"], [f"{base}_blocks"], name=f"{base}_blocks"),
            helper.make_node("ReduceSum", [f"{base}_blocks", f"{base}_lastaxis"], [f"{base}_blocksum"],
                             name=f"{base}_blocksum", keepdims=0)], f"{base}_blocksum"


def _replace(node, weight: np.ndarray, sums: dict, add_init, helper, accuracy_level: int, minimum: str) -> tuple:
    """(nodes that replace MatMul(x, W), grid error, error of the residual rows or 0). rows: [block sums and
    Concat(x, block sums) (first use of x)], MatMulNBits over K + nb. exact: [block sums (first use)], MatMulNBits,
    correction MatMul, Add."""
    k, n = weight.shape
    q = q41_from_weight(weight)
    x, out, base = node.input[0], node.output[0], node.name or node.output[0]
    nodes, row_error = [], 0.0
    if x not in sums:
        nodes, sums[x] = _block_sums(x, k, base, add_init, helper)
        if minimum == Minimum.ROWS:
            nodes.append(helper.make_node("Concat", [x, sums[x]], [f"{base}_augmented"], name=f"{base}_augmented",
                                          axis=-1))
            sums[x] = f"{base}_augmented"
    if minimum == Minimum.ROWS:
        codes, scale, zero_point, row_error = residual_rows(q["residual"], q["scale"])
        q = {"codes": np.concatenate([q["codes"], codes]), "scale": np.concatenate([q["scale"], scale]),
             "zero_point": np.concatenate([q["zero_point"], zero_point]), "grid_error": q["grid_error"]}
    packed, scales, zero_points = matmulnbits_tensors(q)
    for suffix, value in (("Q4", packed), ("scales", scales), ("zp", zero_points)):
        add_init(f"{base}_{suffix}", value)
    if minimum == Minimum.ROWS:  # MatMulNBits pads the last, partial block of the nb extra inputs
        nodes.append(helper.make_node(
            "MatMulNBits", [sums[x], f"{base}_Q4", f"{base}_scales", f"{base}_zp"], [out], name=f"{base}_Q4",
            domain="com.microsoft", K=k + k // BLOCK, N=n, bits=4, block_size=BLOCK, accuracy_level=accuracy_level))
        return nodes, q["grid_error"], row_error
    add_init(f"{base}_min", q["residual"])
    nodes.append(helper.make_node(
        "MatMulNBits", [x, f"{base}_Q4", f"{base}_scales", f"{base}_zp"], [f"{out}_q4"], name=f"{base}_Q4",
        domain="com.microsoft", K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=accuracy_level))
    nodes.append(helper.make_node("MatMul", [sums[x], f"{base}_min"], [f"{out}_min"], name=f"{base}_min"))
    nodes.append(helper.make_node("Add", [f"{out}_q4", f"{out}_min"], [out], name=f"{base}_add"))
    return nodes, q["grid_error"], row_error


HEAD_FILL = -1e30  # logit of a token a trimmed head does not score: its probability is exactly 0 at any usable T


def scatter_back(scored: str, output: str, keep: np.ndarray, vocab: int, base: str, add_init, helper) -> list:
    """Nodes that put a trimmed head's scores [M, N'] (of the sorted token ids `keep`) back to [M, vocab], HEAD_FILL
    for every other token: Pad one fill column, then GatherElements with each token's column (or the fill's), its
    int32 index table expanded to [M, vocab]: faster than Gather along axis 1 (one copy per index) or ScatterElements,
    as `python benchmarks/head_scatter.py` measures (records in benchmarks/results/head-scatter/)."""
    rows = np.full(vocab, len(keep), np.int32)
    rows[keep] = np.arange(len(keep))
    add_init(f"{base}_pads", np.array([0, 0, 0, 1], np.int64))
    add_init(f"{base}_fill", np.array(HEAD_FILL, np.float32))
    add_init(f"{base}_rows", rows[None, :])
    add_init(f"{base}_first", np.array([0], np.int64))
    add_init(f"{base}_vocab", np.array([vocab], np.int64))
    return [
        helper.make_node("Pad", [scored, f"{base}_pads", f"{base}_fill"], [f"{base}_padded"], name=f"{base}_pad",
                         mode="constant"),
        helper.make_node("Shape", [scored], [f"{base}_shape"], name=f"{base}_shape"),
        helper.make_node("Gather", [f"{base}_shape", f"{base}_first"], [f"{base}_m"], name=f"{base}_m", axis=0),
        helper.make_node("Concat", [f"{base}_m", f"{base}_vocab"], [f"{base}_full"], name=f"{base}_full", axis=0),
        helper.make_node("Expand", [f"{base}_rows", f"{base}_full"], [f"{base}_index"], name=f"{base}_index"),
        helper.make_node("GatherElements", [f"{base}_padded", f"{base}_index"], [output], name=f"{base}_scatter",
                         axis=1),
    ]


def _replace_head(node, weight: np.ndarray, add_init, helper, accuracy_level: int, keep=None) -> tuple:
    """Gemm(x, E, transB=1), the LM head over the tied embedding E [N, K] -> 8-bit MatMulNBits on the Q8_0 grid
    (SmolLM2's GGUF stores E as Q8_0, so the head stays exact). The embedding Gather keeps E. keep: sorted token ids
    [N'] of a trimmed head (specdec.calibration.head_trim): MatMulNBits over those rows only, then the scores go back
    to [M, N] (scatter_back). -> (nodes, error)"""
    n, k = weight.shape
    q = q8_0_from_weight(weight if keep is None else weight[keep])
    base = node.name or node.output[0]
    for suffix, value in (("Q8", q["codes"]), ("scales", q["scale"]), ("zp", q["zero_point"])):
        add_init(f"{base}_{suffix}", value)
    scored = list(node.output) if keep is None else [f"{base}_kept"]
    nodes = [helper.make_node(
        "MatMulNBits", [node.input[0], f"{base}_Q8", f"{base}_scales", f"{base}_zp"], scored,
        name=f"{base}_Q8", domain="com.microsoft", K=k, N=len(q["scale"]), bits=8, block_size=BLOCK,
        accuracy_level=accuracy_level,
    )]
    if keep is not None:
        nodes += scatter_back(scored[0], node.output[0], keep, n, base, add_init, helper)
    return nodes, q["grid_error"]


def _is_plain_head(node, inits: dict) -> bool:
    """A bias-free Gemm(x, W, transB=1) with a constant fp32 W [N, K], K % 32 == 0, and alpha 1."""
    if node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in inits:
        return False
    attrs = {a.name: (a.f if a.type == a.FLOAT else a.i) for a in node.attribute}
    weight = inits[node.input[1]]
    plain = attrs.get("transB") == 1 and attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0
    return plain and len(weight.dims) == 2 and weight.dims[1] % BLOCK == 0 and weight.data_type == 1


def _matmul_weights(nodes: list, inits: dict, numpy_helper) -> tuple[dict, dict]:
    """-> ({node index: fp32 [K, N] weight} of the MatMuls q41 rewrites, {input name: their indices, in order})."""
    weights = {}
    for index, node in enumerate(nodes):
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        array = numpy_helper.to_array(weight) if weight is not None else None
        if array is not None and array.ndim == 2 and array.shape[0] % BLOCK == 0 and array.dtype == np.float32:
            weights[index] = array
    groups = {}
    for index in weights:
        groups.setdefault(nodes[index].input[0], []).append(index)
    return weights, groups


def _replace_group(group: list, weights: list, sums: dict, add_init, helper, accuracy_level: int, minimum: str):
    """MatMuls that share their input (q/k/v, gate/up) as one Q4_1 MatMulNBits over the weights side by side, then a
    Split into the original outputs: fewer, larger kernels at T = 1. Each column keeps its own blocks, so the codes
    are those of the MatMuls one by one. -> (nodes, grid error, residual rows' error)"""
    first = group[0]
    base = first.name or first.output[0]
    fused = helper.make_node("MatMul", [first.input[0], f"{base}_fusedW"], [f"{base}_fused_y"], name=f"{base}_fused")
    replaced, error, row_error = _replace(fused, np.concatenate(weights, axis=1), sums, add_init, helper,
                                          accuracy_level, minimum)
    sizes = np.array([w.shape[1] for w in weights], np.int64)
    outputs = [node.output[0] for node in group]
    add_init(f"{base}_split", sizes)
    split = helper.make_node("Split", [f"{base}_fused_y", f"{base}_split"], outputs, name=f"{base}_split", axis=-1)
    return replaced + [split], error, row_error


def q41_from_onnx(source: Path, dest: Path, progress: bool = False, accuracy_level: int = ACCURACY_LEVEL,
                  fuse: bool = True, head_keep: np.ndarray | None = None, minimum: str = Minimum.ROWS) -> dict:
    """Rewrite every constant-weight MatMul of `source` (K % 32 == 0) as Q4_1-grid MatMulNBits with its float
    minimum added back (`minimum`: "rows" or "exact", see the module docstring), and the tied LM head Gemm as 8-bit
    MatMulNBits on the Q8_0 grid. fuse: MatMuls sharing an input become one. head_keep: sorted token ids of a
    trimmed head (see _replace_head).
    -> {"quantized": count, "on_grid": count, "max_grid_error": float, "minimum": minimum,
        "max_minimum_error": float (0 for exact)}"""
    if minimum not in MINIMUMS:
        raise ValueError(f"minimum must be one of {MINIMUMS}, got {minimum!r}")
    try:
        import onnx
        from onnx import helper, numpy_helper
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise missing_dependency("onnx", "export") from exc
    model = onnx.load(str(source))
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    new_inits, sums, nodes, errors, row_errors = [], {}, [], [], [0.0]
    add_init = lambda name, value: new_inits.append(numpy_helper.from_array(value, name))  # noqa: E731
    head_errors = []
    originals = list(graph.node)
    weights, groups = _matmul_weights(originals, inits, numpy_helper)
    opset = next((op.version for op in model.opset_import if op.domain in ("", "ai.onnx")), 1)
    fuse = fuse and opset >= 13  # Split takes its sizes as an input from opset 13
    for index, node in enumerate(tqdm(originals, disable=not progress, desc="q4_1 grid", unit="node")):
        if _is_plain_head(node, inits):
            replaced, error = _replace_head(node, numpy_helper.to_array(inits[node.input[1]]), add_init, helper,
                                            accuracy_level, head_keep)
            nodes.extend(replaced)
            head_errors.append(error)
            continue
        if index not in weights:
            nodes.append(node)
            continue
        group = groups[node.input[0]] if fuse else [index]
        if group[0] != index:
            continue  # fused with the group's first MatMul
        if len(group) == 1:
            replaced, error, row_error = _replace(node, weights[index], sums, add_init, helper, accuracy_level,
                                                  minimum)
        else:
            replaced, error, row_error = _replace_group([originals[i] for i in group], [weights[i] for i in group],
                                                        sums, add_init, helper, accuracy_level, minimum)
        nodes.extend(replaced)
        errors.extend([error] * len(group))
        row_errors.append(row_error)
    used = {name for node in nodes for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.node[:], graph.initializer[:]
    graph.node.extend(nodes)
    graph.initializer.extend(kept + new_inits)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in (dest, dest.with_name(dest.name + ".data")):  # onnx appends to an existing data file
        stale.unlink(missing_ok=True)
    onnx.save(model, str(dest), save_as_external_data=True, location=dest.name + ".data", size_threshold=1024)
    on_grid = sum(e <= GRID_TOLERANCE for e in errors)
    log.info("q4_1 grid: %d MatMuls quantized, %d on the grid; %d LM heads on the Q8_0 grid", len(errors), on_grid,
             len(head_errors))
    stats = {"quantized": len(errors), "on_grid": int(on_grid), "max_grid_error": float(max(errors, default=0.0)),
             "minimum": minimum, "max_minimum_error": float(max(row_errors))}
    if head_errors:
        stats["lm_head"] = {"bits": 8, "grid": "Q8_0", "max_grid_error": float(max(head_errors))}
        if head_keep is not None:
            stats["lm_head"]["kept_tokens"] = int(len(head_keep))
    return stats
