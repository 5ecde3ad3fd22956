"""A target's weights as the native kernels hold them, read from its exported gqa graph.

The reader accepts the LLaMA layout our gqa export writes and nothing else: per layer a (Skip)SimplifiedLayerNorm,
one q/k/v MatMul into GroupQueryAttention (rotary inside, not interleaved), the o MatMul, a SkipSimplifiedLayerNorm,
one gate/up MatMul split in halves, SiLU(gate)·up, the down MatMul; a final norm and a bias-free LM head. Every
linear weight must lie on a Q4_1 grid and the head on a Q8_0 grid (a GGUF's, exported): then the kernels compute
the graph's own function.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.calibration.q41 import q41_from_weight, q8_0_from_weight
from specdec.errors import BackendError, missing_dependency
from specdec.manifest import ModelDims

BLOCK = 32
BLOCK4 = np.dtype([("d", "<f4"), ("m", "<f4"), ("qs", "u1", 16)])  # kernels.c's blk4
BLOCK8 = np.dtype([("d", "<f4"), ("qs", "i1", 32)])  # kernels.c's blk8
BLOCK4P = np.dtype([("h", "<f2", 4), ("qs", "u1", 32)])  # kernels.c's blk4p: two BLOCK4 of a column, the draft's
GRID_TOLERANCE = 1e-4  # max |w − dequant| / d: fp32 rounding, not a coarser grid
ALLOWED_OPS = {"Shape", "Squeeze", "Gather", "Add", "Sub", "Cast", "ReduceMax", "SimplifiedLayerNormalization",
               "SkipSimplifiedLayerNormalization", "MatMul", "GroupQueryAttention", "Split", "Sigmoid", "Mul",
               "Reshape", "Gemm", "Concat"}
HINT = "use backend='onnxruntime' (the native backend runs LLaMA-layout gqa targets exported from a Q4_1 GGUF)"


@dataclass
class Layer:
    input_norm: np.ndarray  # [H]
    post_norm: np.ndarray  # [H]
    qkv: np.ndarray  # [(Hq + 2 Hkv) D, H / 32] of BLOCK4
    o: np.ndarray  # [H, Hq D / 32]
    gate_up: np.ndarray  # [2 I, H / 32]
    down: np.ndarray  # [H, I / 32]


@dataclass
class NativeWeights:
    embedding: np.ndarray | None  # [V, H] float32; None where the head's Q8_0 blocks hold it exactly (tied weights)
    layers: list
    final_norm: np.ndarray  # [H]
    head: np.ndarray  # [V, H / 32] of BLOCK8
    cos: np.ndarray  # [positions, D / 2], GroupQueryAttention's rotary tables
    sin: np.ndarray
    epsilon: float
    scale: float  # attention scores' scale


def q41_blocks(weight: np.ndarray) -> tuple[np.ndarray, float]:
    """weight [N, K] -> (blocks [N, K/32] of BLOCK4, max |w − d·q − m| / d), the fit of specdec.calibration.q41."""
    q = q41_from_weight(weight.T)  # codes [nb, 32, N]; scale, minimum [nb, N]
    codes = q["codes"].transpose(2, 0, 1)  # [N, nb, 32]
    out = np.zeros(codes.shape[:2], BLOCK4)
    out["d"], out["m"] = q["scale"].T, q["minimum"].T
    out["qs"] = codes[..., :16] | (codes[..., 16:] << 4)
    return out, q["grid_error"]


def q41_pairs(blocks: np.ndarray) -> np.ndarray:
    """blocks [N, nb] of BLOCK4 -> [N, ceil(nb / 2)] of BLOCK4P: each two blocks' d0, d1, m0, m1 in fp16 (a GGUF's
    own precision; elsewhere the draft's scales round to 11 bits) and their codes q0[j] | q1[j] << 4. An odd nb ends
    in a pair whose second block is 0."""
    if blocks.shape[1] % 2:
        blocks = np.concatenate([blocks, np.zeros((len(blocks), 1), BLOCK4)], axis=1)
    codes = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=-1)  # [N, nb, 32]
    out = np.empty((len(blocks), blocks.shape[1] // 2), BLOCK4P)
    out["h"] = np.stack([blocks["d"][:, 0::2], blocks["d"][:, 1::2], blocks["m"][:, 0::2], blocks["m"][:, 1::2]], -1)
    out["qs"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return out


def q8_blocks(weight: np.ndarray) -> tuple[np.ndarray, float]:
    """weight [N, K] -> (blocks [N, K/32] of BLOCK8, max |w − d·q| / d), the fit of specdec.calibration.q41."""
    q = q8_0_from_weight(weight)  # codes [N, nb, 32] as q + 128; scale [N, nb]
    out = np.zeros(q["scale"].shape, BLOCK8)
    out["d"], out["qs"] = q["scale"], (q["codes"].astype(np.int16) - 128).astype(np.int8)
    return out, q["grid_error"]


def q8_rows(blocks: np.ndarray) -> np.ndarray:
    """blocks [N, nb] of BLOCK8 -> their values [N, nb * 32] float32, d * q as the kernels compute it."""
    return (blocks["d"][..., None] * blocks["qs"].astype(np.float32)).reshape(len(blocks), -1)


def head_holds(head: np.ndarray, embedding: np.ndarray, rows: int = 4096) -> bool:
    """Whether the head's Q8_0 blocks [V, H / 32] give the embedding [V, H] exactly (d * q in float32, as the
    kernels compute it): tied weights on the grid, so the kernels read the embedding's rows from the head and the
    float32 copy (113 MB for the default model) is not kept. Compared a few thousand rows at a time."""
    if embedding.shape != (head.shape[0], head.shape[1] * BLOCK):
        return False
    for start in range(0, len(head), rows):
        if not np.array_equal(q8_rows(head[start : start + rows]), embedding[start : start + rows]):
            return False
    return True


def _on_grid(name: str, weight: np.ndarray, blocks_of) -> np.ndarray:
    # weight: [N, K]
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise BackendError(f"{name} has shape {list(weight.shape)}; the native kernels need K % {BLOCK} == 0", HINT)
    blocks, error = blocks_of(np.ascontiguousarray(weight, dtype=np.float32))
    if error > GRID_TOLERANCE:
        grid = "Q4_1" if blocks_of is q41_blocks else "Q8_0"
        raise BackendError(f"{name} is not on a {grid} grid (max error {error:.3g} of a step)", HINT)
    return blocks


def _parts(graph, inits: dict, dims: ModelDims, path: Path) -> dict:
    """The graph's nodes by role, after checking that it has the layout of the module docstring."""
    nodes = list(graph.node)
    stray = sorted({node.op_type for node in nodes} - ALLOWED_OPS)
    biased = [node.name for node in nodes if node.op_type == "Add" and any(i in inits for i in node.input)]
    if stray or biased:
        raise BackendError(f"{path} holds {', '.join(stray + biased)}, which the native backend does not run", HINT)
    parts = {"norms": [n for n in nodes if n.op_type.endswith("SimplifiedLayerNormalization")],
             "matmuls": [n for n in nodes if n.op_type == "MatMul" and n.input[1] in inits],
             "attention": [n for n in nodes if n.op_type == "GroupQueryAttention"],
             "heads": [n for n in nodes if n.op_type == "Gemm" and n.input[1] in inits],
             "embeddings": [n for n in nodes
                            if n.op_type == "Gather" and n.input[1] == "input_ids" and n.input[0] in inits]}
    layers = dims.num_layers
    expected = {"norms": 2 * layers + 1, "matmuls": 4 * layers, "attention": layers, "heads": 1, "embeddings": 1}
    counts = {role: len(found) for role, found in parts.items()}
    if counts != expected:
        raise BackendError(f"{path} is not a LLaMA-layout gqa graph of {layers} layers: it has {counts}, the layout "
                           f"{expected}", HINT)
    return parts


def _attributes(node, onnx) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _check_attention(attrs: dict, node, dims: ModelDims, path: Path) -> None:
    seen = (attrs.get("num_heads"), attrs.get("kv_num_heads"), attrs.get("do_rotary"),
            attrs.get("rotary_interleaved", 0), attrs.get("softcap", 0.0), attrs.get("local_window_size", -1),
            len(node.input) >= 9)  # ... and its rotary tables cos_cache, sin_cache
    if seen != (dims.num_heads, dims.num_kv_heads, 1, 0, 0.0, -1, True):
        raise BackendError(f"{path}'s attention has attributes {attrs}, which the native backend does not run", HINT)


def _array(init, folder: Path, numpy_helper) -> np.ndarray:
    """An initializer's values. One held in an external data file is read from it on every call, and the proto
    keeps no copy of it."""
    values = numpy_helper.to_array(init, str(folder))  # holds its own reference to the bytes read
    if init.data_location == init.EXTERNAL:
        init.ClearField("raw_data")  # what to_array read in from the file
    return values


def weights_from_onnx(path: Path, dims: ModelDims) -> NativeWeights:
    """Read and check the graph at `path` (see the module docstring)."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as exc:
        raise missing_dependency("onnx", "native") from exc
    model = onnx.load(str(path), load_external_data=False)  # each weight is read when it is converted: less memory
    inits = {init.name: init for init in model.graph.initializer}
    array = lambda name: _array(inits[name], path.parent, numpy_helper)  # noqa: E731
    parts = _parts(model.graph, inits, dims, path)
    norms, matmuls, attention, head = parts["norms"], parts["matmuls"], parts["attention"][0], parts["heads"][0]
    attrs = _attributes(attention, onnx)
    _check_attention(attrs, attention, dims, path)
    if _attributes(head, onnx).get("transB") != 1 or len(head.input) > 2:
        raise BackendError(f"{path}'s LM head is not a bias-free Gemm with transB = 1", HINT)
    packed = inits[matmuls[0].input[1]].dims[1]  # q/k/v side by side: [H, (Hq + 2 Hkv) D] (not read twice)
    if packed != (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim:
        raise BackendError(f"{path}'s first weight has {packed} columns, not packed q/k/v", HINT)

    def gamma(node):
        return array(node.input[1] if node.op_type == "SimplifiedLayerNormalization" else node.input[2])

    def weight(node):  # ONNX MatMul B: [K, N]
        return _on_grid(node.name, array(node.input[1]).T, q41_blocks)

    layers = [Layer(gamma(norms[2 * i]), gamma(norms[2 * i + 1]), *(weight(m) for m in matmuls[4 * i : 4 * i + 4]))
              for i in range(dims.num_layers)]
    head_blocks = _on_grid(head.name, array(head.input[1]), q8_blocks)  # its fp32 weight freed before the embedding
    embedding = array(parts["embeddings"][0].input[0]).astype(np.float32)
    return NativeWeights(
        embedding=None if head_holds(head_blocks, embedding) else embedding, layers=layers,
        final_norm=gamma(norms[-1]), head=head_blocks,
        cos=array(attention.input[7]).astype(np.float32), sin=array(attention.input[8]).astype(np.float32),
        epsilon=float(_attributes(norms[0], onnx).get("epsilon", 1e-5)),
        scale=float(attrs.get("scale") or dims.head_dim ** -0.5))


def trimmed_head_rows(path: Path, vocab: int) -> np.ndarray | None:
    """The sorted token ids a draft graph's trimmed head scores (specdec.calibration.q41.scatter_back: its
    GatherElements' [1, vocab] column table, column len(keep) for the fill), or None where the head is whole."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as exc:
        raise missing_dependency("onnx", "native") from exc
    model = onnx.load(str(path), load_external_data=False)
    made_by = {out: node for node in model.graph.node for out in node.output}
    inits = {init.name: init for init in model.graph.initializer}
    scatters = [node for node in model.graph.node if node.op_type == "GatherElements"]
    if not scatters:
        return None
    expand, pad = made_by.get(scatters[0].input[1]), made_by.get(scatters[0].input[0])
    head = made_by.get(pad.input[0]) if pad is not None and pad.op_type == "Pad" else None
    table = inits.get(expand.input[0]) if expand is not None and expand.op_type == "Expand" else None
    scored = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}.get("N") if head else None
    if len(scatters) != 1 or table is None or scored is None:
        raise BackendError(f"{path} holds a GatherElements that is not a trimmed head's scatter", HINT)
    columns = _array(table, path.parent, numpy_helper).reshape(-1)  # each token's column of the scores; `scored`:
    # the fill
    kept = np.flatnonzero(columns != scored)
    if columns.shape != (vocab,) or not np.array_equal(columns[kept], np.arange(scored)):
        raise BackendError(f"{path}'s head table ({columns.size} entries) does not map a vocabulary of {vocab} onto "
                           f"{scored} scored tokens", HINT)
    return kept
