"""The native engine's weights, written into a bundle (specdec.blocks): read once from the exported gqa graph, fitted
onto the GGUF grids and checked there, so that the runtime only reads them.

The reader accepts the LLaMA layout our gqa export writes and nothing else: per layer a (Skip)SimplifiedLayerNorm,
one q/k/v MatMul (plus a bias: Qwen2; or each head of q and k RMS-normalized on its way: Qwen3) into
GroupQueryAttention (rotary inside, not interleaved), the o MatMul, a SkipSimplifiedLayerNorm,
one gate/up MatMul split in halves, SiLU(gate)·up, the down MatMul; a final norm and a bias-free LM head. Or GPT-2's
layout as the gqa lowering writes it: the same with LayerNormalization for every norm, GroupQueryAttention without
rotary (a learned positions table Gathered at each token's position and added to its embedding), a bias Add after
every MatMul, and one up MatMul into FastGelu or Gelu in place of gate/up and SiLU. Where every
linear weight lies on a Q4_1 grid (or every one on a Q8_0 grid, or each on one of a K-quant file's grids) and the
head on a Q8_0 grid (a GGUF's, exported), the weights keep those blocks and the kernels compute the graph's own function. Weights off those grids are kept in the narrowest of bf16, f16 and fp32 that holds every
one exactly (a bf16 checkpoint exported to fp32 keeps 2 bytes a weight): the same function again. A graph outside
the layout, or with a NaN or inf weight, gets no native weights (NativeSkipped).
"""
from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import numpy as np

from specdec.blocks import (BLOCK4, BLOCK8, GridError, float_rows, head_holds, mixed_blocks, on_grid, q41_blocks,
                            q41_pairs, q8_blocks, row_precision, rows_of)
from specdec.weight_kinds import LayoutName
from specdec.weights_file import FORMAT_VERSION, write_tensors
from specdec.errors import missing_dependency
from specdec.manifest import Activation, ModelDims, NativeRecord
from specdec.native.weights import LINEARS

class Op(StrEnum):
    """The ONNX op types the reader accepts in a gqa graph (anything else: NativeSkipped)."""

    SHAPE = "Shape"
    SQUEEZE = "Squeeze"
    GATHER = "Gather"
    ADD = "Add"
    SUB = "Sub"
    CAST = "Cast"
    REDUCE_MAX = "ReduceMax"
    SIMPLIFIED_LAYER_NORMALIZATION = "SimplifiedLayerNormalization"
    SKIP_SIMPLIFIED_LAYER_NORMALIZATION = "SkipSimplifiedLayerNormalization"
    MAT_MUL = "MatMul"
    GROUP_QUERY_ATTENTION = "GroupQueryAttention"
    SPLIT = "Split"
    SIGMOID = "Sigmoid"
    MUL = "Mul"
    RESHAPE = "Reshape"
    GEMM = "Gemm"
    CONCAT = "Concat"
    LAYER_NORMALIZATION = "LayerNormalization"
    FAST_GELU = "FastGelu"
    GELU = "Gelu"
    RANGE = "Range"
    UNSQUEEZE = "Unsqueeze"


ALLOWED_OPS = set(Op)
NORMS = (Op.SIMPLIFIED_LAYER_NORMALIZATION, Op.SKIP_SIMPLIFIED_LAYER_NORMALIZATION,
         Op.LAYER_NORMALIZATION)  # a layer's and the final norm: RMSNorm, or LayerNorm (GPT-2's)
GELUS = {Op.FAST_GELU: Activation.GELU_TANH, Op.GELU: Activation.GELU}  # an ungated MLP's activation (GPT-2's)
TABLES = ("cos", "sin", "positions")  # the position tables: rotary's, or learned ones (GPT-2's)
TARGET_FILE, DRAFT_FILE = "native.bin", "native.bin"  # in the model's folder


class NativeSkipped(Exception):
    """Why a model gets no native weights (a message for the log and the manifest's reader, not an error)."""


def _onnx():
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as exc:
        raise missing_dependency("onnx", "export") from exc
    return onnx, numpy_helper


def _parts(graph, inits: dict, dims: ModelDims, path: Path) -> dict:
    """The graph's nodes by role, after checking that it has the layout of the module docstring."""
    nodes = list(graph.node)
    stray = sorted({node.op_type for node in nodes} - ALLOWED_OPS)
    biases, others = _biases(nodes, inits)
    if stray or others:
        raise NativeSkipped(f"{path.name} holds {', '.join(stray + others)}, which the native engine does not run")
    made_by = {output: node for node in nodes for output in node.output}
    head_norms = {id(n) for n in nodes if n.op_type == Op.SIMPLIFIED_LAYER_NORMALIZATION
                  and getattr(made_by.get(n.input[0]), "op_type", None) == Op.RESHAPE}  # a head's q or k (Qwen3)
    norm_ops = {n.op_type for n in nodes if n.op_type in NORMS and id(n) not in head_norms}
    gathers = [n for n in nodes if n.op_type == Op.GATHER and n.input[0] in inits]
    fed = {value.name for value in graph.input}  # the embedding Gathers by a graph input (the token ids); a learned
    # position table by positions the graph computes
    parts = {"norms": [n for n in nodes if n.op_type in NORMS and id(n) not in head_norms],
             "matmuls": [n for n in nodes if n.op_type == Op.MAT_MUL and n.input[1] in inits],
             "attention": [n for n in nodes if n.op_type == Op.GROUP_QUERY_ATTENTION],
             "heads": [n for n in nodes if n.op_type == Op.GEMM and n.input[1] in inits],
             "embeddings": [n for n in gathers if n.input[1] in fed],
             "positions": [n for n in gathers if n.input[1] not in fed],  # a learned table (GPT-2)
             "gelus": [n for n in nodes if n.op_type in GELUS]}
    layers, learned = dims.num_layers, int(bool(parts["positions"]))
    expected = {"norms": 2 * layers + 1, "matmuls": 4 * layers, "attention": layers, "heads": 1, "embeddings": 1,
                "positions": learned, "gelus": layers if parts["gelus"] else 0}
    counts = {role: len(found) for role, found in parts.items()}
    mixed_norms = Op.LAYER_NORMALIZATION in norm_ops and len(norm_ops) > 1  # LayerNorm beside RMSNorm
    if counts != expected or mixed_norms or len({n.op_type for n in parts["gelus"]}) > 1:
        raise NativeSkipped(f"{path.name} is not a LLaMA- or GPT-2-layout gqa graph of {layers} layers: it has "
                            f"{counts}, norms {sorted(norm_ops)}")
    parts["biases"] = biases
    parts["activation"] = GELUS[parts["gelus"][0].op_type] if parts["gelus"] else Activation.SILU_GATED
    parts["qk_norms"] = _qk_norms(parts["attention"], made_by, len(head_norms), path)
    return parts


def _qk_norms(attention: list, made_by: dict, count: int, path: Path) -> list:
    """[(q norm, k norm) node of each layer] where the graph normalizes each head of q and k before its attention
    (Qwen3: the packed q/k/v split, q and k each reshaped to heads, normalized and reshaped back, concatenated with
    v), else []."""
    if not count:
        return []
    found = []
    for node in attention:
        concat = made_by.get(node.input[0])
        sources = [made_by.get(name) for name in concat.input] if concat is not None and concat.op_type == Op.CONCAT else []
        norms = [made_by.get(source.input[0]) if source is not None and source.op_type == Op.RESHAPE else None
                 for source in sources[:2]]
        if len(sources) != 3 or any(n is None or n.op_type != Op.SIMPLIFIED_LAYER_NORMALIZATION for n in norms) or \
                sources[2] is None or sources[2].op_type != Op.SPLIT:
            raise NativeSkipped(f"{path.name} normalizes heads of q and k in a way the native engine does not read")
        found.append(tuple(norms))
    if 2 * len(found) != count:
        raise NativeSkipped(f"{path.name} has {count} per-head norms for {len(found)} attention layers")
    return found


def _biases(nodes: list, inits: dict) -> tuple[dict, list]:
    """({MatMul output: its bias initializer}, [names of other Adds of an initializer]): a bias is an Add of one
    initializer to a MatMul's output (Qwen2's on q/k/v, GPT-2's on every product); the native engine runs no other
    Add of a constant."""
    made_by = {output: node for node in nodes for output in node.output}
    biases, others = {}, []
    for node in nodes:
        constant = [name for name in node.input if name in inits]
        if node.op_type != Op.ADD or not constant:
            continue
        varying = [made_by.get(name) for name in node.input if name not in inits]
        source = varying[0] if len(constant) == 1 and len(varying) == 1 else None
        if source is not None and source.op_type == Op.MAT_MUL and source.input[1] in inits:
            biases[source.output[0]] = constant[0]
        else:
            others.append(node.name)
    return biases, others


def _attributes(node, onnx) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _check_attention(attrs: dict, node, dims: ModelDims, rotary: bool) -> int:
    """The keys a query sees (a sliding window: local_window_size), or 0 for every earlier key; NativeSkipped for
    attributes the native engine does not run. rotary: whether the attention rotates q and k (else the graph adds
    learned positions to its embedding)."""
    window = attrs.get("local_window_size", -1)
    tables = len(node.input) >= 9 and all(node.input[7:9])  # its rotary tables cos_cache, sin_cache
    seen = (attrs.get("num_heads"), attrs.get("kv_num_heads"), attrs.get("do_rotary", 0),
            attrs.get("rotary_interleaved", 0), attrs.get("softcap", 0.0), window == -1 or window > 0, tables)
    if seen != (dims.num_heads, dims.num_kv_heads, int(rotary), 0, 0.0, True, rotary):
        raise NativeSkipped(f"the attention has attributes {attrs}, which the native engine does not run")
    return max(window, 0)


def _array(init, folder: Path, numpy_helper) -> np.ndarray:
    """An initializer's values; one held in external data is read from its file, and the proto keeps no copy."""
    values = numpy_helper.to_array(init, str(folder))
    if init.data_location == init.EXTERNAL:
        init.ClearField("raw_data")
    return values


def _mixed(linears: dict, packed: dict) -> dict:
    """Each linear weight in its own blocks (mixed_blocks); a packed q/k/v (`packed`: its name -> its v rows) whose
    v rows lie on another grid than its q/k rows as two, `.qkv` its q/k rows and `.qkv_v` its v rows, where no one
    block holds both (Q4_K beside Q6_K, as llama.cpp's Q4_K_M mixes them where rows are a multiple of 256) or two
    take fewer bytes (Q5_0 beside Q8_0). GridError where a weight fits none."""
    tensors = {}
    for name, weight in linears.items():
        v_rows = packed.get(name)
        if v_rows is None:
            tensors[name] = mixed_blocks(name, weight)
            continue
        try:
            whole = mixed_blocks(name, weight)
        except GridError:
            whole = None
        try:
            parts = mixed_blocks(f"{name} (q/k rows)", weight[:-v_rows]), mixed_blocks(f"{name} (v rows)",
                                                                                         weight[-v_rows:])
        except GridError:
            if whole is None:
                raise
            parts = None
        if parts is None or (whole is not None and whole.nbytes <= parts[0].nbytes + parts[1].nbytes):
            tensors[name] = whole
        else:  # apart: fewer bytes (q/k Q5_0 as blk5 beside v Q8_0), or the only way (Q4_K beside Q6_K)
            tensors[name], tensors[f"{name}_v"] = parts
    return tensors


def _grids(linears: dict, head: np.ndarray, embedding: np.ndarray, packed: dict) -> tuple[LayoutName, dict] | None:
    """(layout, tensors) of the weights where every linear weight lies on a Q4_1 grid ("q41"), or every one on a
    Q8_0 grid ("q80", a Q8_0 GGUF's), with the head on Q8_0's; or each linear weight and the head on one of a K-quant
    GGUF's grids ("mixed": blk4, blk5, blk8 or blk6, a Q4_K_M file's, whose head is often Q6_K). The embedding is read
    from the head's blocks where they hold it, else kept in fp32. None where none holds."""
    try:
        head8 = on_grid("head", head, q8_blocks)
    except GridError:
        head8 = None
    fits = {LayoutName.Q41: (lambda: {name: on_grid(name, w, q41_blocks) for name, w in linears.items()},
                             lambda: head8),
            LayoutName.Q80: (lambda: {name: on_grid(name, w, q8_blocks) for name, w in linears.items()},
                             lambda: head8),
            LayoutName.MIXED: (lambda: _mixed(linears, packed),
                      lambda: head8 if head8 is not None else mixed_blocks("head", head))}
    for layout, (fit, fit_head) in fits.items():
        try:
            tensors, head_blocks = fit(), fit_head()
        except GridError:
            continue
        if head_blocks is None:
            continue
        tensors["head"] = head_blocks
        if not head_holds(head_blocks, embedding):
            tensors["embedding"] = embedding
        return layout, tensors
    return None


def _rows(linears: dict, head: np.ndarray, embedding: np.ndarray) -> tuple[LayoutName, dict]:
    """(layout, tensors) of the weights as rows in the narrowest exact precision (the layout named as its rows'
    TensorKind); the embedding only where it is not the head (untied)."""
    tied = embedding.shape == head.shape and np.array_equal(embedding, head)
    try:
        precision = row_precision([*linears.values(), head] + ([] if tied else [embedding]))
    except GridError as exc:
        raise NativeSkipped(str(exc)) from exc
    tensors = {name: rows_of(weight, precision) for name, weight in linears.items()}
    tensors["head"] = rows_of(head, precision)
    if not tied:
        tensors["embedding"] = rows_of(embedding, precision)
    return LayoutName(precision), tensors


def _float(values: np.ndarray) -> np.ndarray:
    """An initializer as float32 (a bf16 graph's come as ml_dtypes.bfloat16, which converts exactly)."""
    return np.ascontiguousarray(values.astype(np.float32))


def native_tensors(path: Path, dims: ModelDims) -> tuple[LayoutName, dict, dict]:
    """(layout, its tensors (specdec.native.weights), the record's scalars: epsilon, scale, window, activation) of
    the gqa graph at `path`; NativeSkipped where the graph is outside the layout or a weight is not finite."""
    onnx, numpy_helper = _onnx()
    model = onnx.load(str(path), load_external_data=False)  # each weight is read when it is converted: less memory
    inits = {init.name: init for init in model.graph.initializer}
    array = lambda name: _array(inits[name], path.parent, numpy_helper)  # noqa: E731
    parts = _parts(model.graph, inits, dims, path)
    norms, matmuls, attention, head = parts["norms"], parts["matmuls"], parts["attention"][0], parts["heads"][0]
    attrs, rotary = _attributes(attention, onnx), not parts["positions"]
    window = _check_attention(attrs, attention, dims, rotary)
    if any(_check_attention(_attributes(node, onnx), node, dims, rotary) != window for node in parts["attention"]):
        raise NativeSkipped(f"{path.name}'s layers have different sliding windows")
    if len({_attributes(node, onnx).get("scale") for node in parts["attention"]}) > 1:
        raise NativeSkipped(f"{path.name}'s layers scale their attention scores differently")
    if _attributes(head, onnx).get("transB") != 1 or len(head.input) > 2:
        raise NativeSkipped(f"{path.name}'s LM head is not a bias-free Gemm with transB = 1")
    if inits[matmuls[0].input[1]].dims[1] != (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim:
        raise NativeSkipped(f"{path.name}'s first weight is not packed q/k/v")
    eps = {_attributes(n, onnx).get("epsilon", 1e-5) for n in norms + [n for pair in parts["qk_norms"] for n in pair]}
    if len(eps) > 1:
        raise NativeSkipped(f"{path.name}'s norms have epsilons {sorted(eps)}; the native engine takes one")
    if any(_attributes(n, onnx).get("axis", -1) != -1 or len(n.input) < 3 or not n.input[2] for n in norms
           if n.op_type == Op.LAYER_NORMALIZATION):
        raise NativeSkipped(f"{path.name} has a LayerNormalization the native engine does not run (one over the last "
                            "axis, with scale and bias)")

    def gamma(node):  # the norm's scale
        return array(node.input[2] if node.op_type == Op.SKIP_SIMPLIFIED_LAYER_NORMALIZATION else node.input[1])

    def norm(name, node):  # the norm's scale, and a LayerNorm's bias
        tensors[name] = gamma(node)
        if node.op_type == Op.LAYER_NORMALIZATION:
            tensors[f"{name}_bias"] = array(node.input[2])

    tensors, linears = {}, {}
    for i in range(dims.num_layers):
        norm(f"layers.{i}.input_norm", norms[2 * i])
        norm(f"layers.{i}.post_norm", norms[2 * i + 1])
        for name, node in zip(LINEARS, matmuls[4 * i : 4 * i + 4]):
            linears[f"layers.{i}.{name}"] = _float(array(node.input[1]).T)  # B: [K, N]
            bias = parts["biases"].get(node.output[0])
            if bias is not None:
                tensors[f"layers.{i}.{name}_bias"] = _float(array(bias))
        if parts["qk_norms"]:
            q_norm, k_norm = parts["qk_norms"][i]
            tensors[f"layers.{i}.q_norm"], tensors[f"layers.{i}.k_norm"] = gamma(q_norm), gamma(k_norm)
    for name in LINEARS:  # every layer's product of a kind has a bias, or none has
        biased = sum(f"layers.{i}.{name}_bias" in tensors for i in range(dims.num_layers))
        if biased not in (0, dims.num_layers):
            raise NativeSkipped(f"{path.name} has a bias on the {name} product of {biased} of its {dims.num_layers} "
                                "layers")
    head_weight, embedding = _float(array(head.input[1])), _float(array(parts["embeddings"][0].input[0]))
    for name, weight in [*linears.items(), ("head", head_weight), ("embedding", embedding)]:
        if weight.ndim != 2 or weight.shape[1] % 32:
            raise NativeSkipped(f"{name} has shape {list(weight.shape)}; the native kernels need K % 32 == 0")
    packed = {f"layers.{i}.{LINEARS[0]}": dims.num_kv_heads * dims.head_dim for i in range(dims.num_layers)}  # q/k/v
    grids = _grids(linears, head_weight, embedding, packed) if np.isfinite(embedding).all() else None
    layout, found = grids if grids is not None else _rows(linears, head_weight, embedding)
    tensors.update(found)
    norm("final_norm", norms[-1])
    if rotary:
        tensors["cos"], tensors["sin"] = array(attention.input[7]), array(attention.input[8])
    else:
        tensors["positions"] = array(parts["positions"][0].input[0])  # [positions, H], added to each embedding
        if tensors["positions"].shape[1:] != (dims.hidden_size,):
            raise NativeSkipped(f"{path.name}'s learned positions are {list(tensors['positions'].shape)}, not "
                                f"[positions, {dims.hidden_size}]")
    for name in [n for n in tensors if n.endswith(("norm", "_bias"))] + [n for n in TABLES if n in tensors]:
        tensors[name] = _float(tensors[name])
    epsilon = float(_attributes(norms[0], onnx).get("epsilon", 1e-5))
    return layout, tensors, dict(epsilon=epsilon, scale=float(attrs.get("scale") or dims.head_dim ** -0.5),
                                 window=window, activation=parts["activation"])


def _record(layout: LayoutName, root: Path, rel: str, tensors: dict, **scalars) -> NativeRecord:
    index = write_tensors(root / rel, tensors)
    return NativeRecord(layout=layout, abi=FORMAT_VERSION, path=rel, tensors={
        name: {"kind": entry.kind, "shape": list(entry.shape), "offset": entry.offset} for name, entry in index.items()},
        **scalars)


def write_target(root: Path, role: str, dims: ModelDims) -> NativeRecord:
    """Write root/role/native.bin from root/role/model.onnx; NativeSkipped where the graph cannot have one."""
    layout, tensors, scalars = native_tensors(root / role / "model.onnx", dims)
    return _record(layout, root, f"{role}/{TARGET_FILE}", tensors, **scalars)


def write_draft(root: Path, role: str, layout: LayoutName, target: dict, keep: np.ndarray | None,
                fill: float) -> NativeRecord:
    """Write root/role/native.bin for an int4-q41 draft of the target whose tensors of `layout` are `target`: its
    linear weights in pairs of Q4_1 blocks (the target's own, or fitted to its rows), its head's rows `keep` (token
    ids; None: every row) on the Q8_0 grid (the target's, or fitted). `layout`: the target's (its tensors' dtypes
    say how to read them)."""
    def q41_of(name):  # the target's own Q4_1 blocks, else fitted to its values (rows, or a GGUF's other blocks)
        w, v = np.asarray(target[name]), target.get(f"{name}_v")  # ... with a mixed target's own v rows
        if v is None:
            return w if w.dtype == BLOCK4 else q41_blocks(float_rows(w))[0]
        return q41_blocks(np.concatenate([float_rows(w), float_rows(np.asarray(v))]))[0]

    tensors = {f"{name}_p": q41_pairs(q41_of(name)) for name in target
               if name.startswith("layers.") and name.rsplit(".", 1)[1] in LINEARS}
    head = np.asarray(target["head"])
    head = head if keep is None else head[keep]
    tensors["head"] = np.ascontiguousarray(head) if head.dtype == BLOCK8 else q8_blocks(float_rows(head))[0]
    if keep is not None:
        tensors["head_rows"] = np.asarray(keep, dtype=np.int64)
    return _record(LayoutName.Q41_DRAFT, root, f"{role}/{DRAFT_FILE}", tensors, fill=fill)
