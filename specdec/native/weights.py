"""A bundle's native weights, read from the file export wrote (specdec.blocks: a private copy on huge pages, or the
file mapped shared), checked against the model's dims. No onnx, no fitting.

Layouts (the manifest's NativeRecord.layout):
- "q41": a target whose linear weights lie on a GGUF Q4_1 grid and whose head on a Q8_0 grid. Tensors: per layer
  `layers.{i}.input_norm`, `.post_norm` [H] f32, `.qkv` [(Hq + 2 Hkv) D, H / 32], `.o` [H, Hq D / 32], `.gate_up`
  [2 I, H / 32], `.down` [H, I / 32] of blk4; `final_norm` [H]; `head` [V, H / 32] of blk8; `cos`, `sin`
  [positions, D / 2]; `embedding` [V, H] f32 only where the head's blocks do not hold it (untied weights); and in
  every layout, for a family whose products have biases, `layers.{i}.{linear}_bias` [N] f32 (Qwen2's on q/k/v,
  GPT-2's on all four), for one that normalizes each head of q and k before rotary (Qwen3), `layers.{i}.q_norm` and
  `.k_norm` [D] f32, and for GPT-2's layout: LayerNorm biases `layers.{i}.input_norm_bias`, `.post_norm_bias` and
  `final_norm_bias` [H] f32, learned `positions` [positions, H] f32 in place of `cos` and `sin`, and `.gate_up` the
  MLP's up rows alone [I, H / 32] (the record's activation: GELU of them).
- "q80": the same for a Q8_0 GGUF: every linear weight on a Q8_0 grid, as blk8 [N, K / 32] (4.5 bits a weight
  more than Q4_1's, no minimum).
- "mixed": a K-quant GGUF's target (Q4_K_M, Q5_K_M): each linear weight in the blocks of its own grid, blk4
  (Q4_K, Q4_1), blk5 (Q5_0, Q5_1, Q5_K), blk8 (Q8_0) or blk6 (Q6_K: a scale per 16), [N, K / 32] each; a layer whose
  v rows lie on another grid than its q/k rows holds them apart, `.qkv` [(Hq + Hkv) D, H / 32] and `.qkv_v`
  [Hkv D, H / 32]; the head blk8 as in "q41".
- "bf16", "f16", "f32": a target in a checkpoint's own precision: the same tensors, with the linear weights and the
  head as rows [N, K] of that dtype (bf16 as its top 16 bits), and `embedding` [V, H] of it only where it is not the
  head (untied weights).
- "q41-draft": the int4-q41 draft of such a target, run on the target's norms and rotary tables: per layer `.qkv_p`,
  `.o_p`, `.gate_up_p`, `.down_p` (the same Q4_1 blocks in pairs, blk4p), its head's rows `head` [V', H / 32] of
  blk8 and the distinct token ids they score, `head_rows` [V'] i64 (the others get the record's fill).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import BackendError
from specdec.manifest import (Activation, FamilyRecord, Method, ModelDims, ModelEntry, NativeRecord, NormKind,
                              PositionKind)
from specdec.weight_kinds import MIXED_KINDS, WEIGHT_LAYOUTS, LayoutName
from specdec.weights_file import CHUNK, Pages, check_extent, check_format, index_from, nonfinite, read_tensors

HINT = "re-export the bundle with this specdec (specdec-export writes native weights), or use backend='onnxruntime'"
LINEARS = ("qkv", "o", "gate_up", "down")


@dataclass
class Layer:
    input_norm: np.ndarray  # [H]
    post_norm: np.ndarray  # [H]
    qkv: np.ndarray  # [(Hq + 2 Hkv) D, H / 32] of BLOCK4
    o: np.ndarray  # [H, Hq D / 32]
    gate_up: np.ndarray  # [2 I, H / 32]
    down: np.ndarray  # [H, I / 32]
    qkv_bias: np.ndarray | None = None  # [(Hq + 2 Hkv) D] float32: q/k/v biases (Qwen2), or None
    qkv_v: np.ndarray | None = None  # [Hkv D, H / 32]: a "mixed" layer's v rows on another grid (qkv: its q/k rows)
    q_norm: np.ndarray | None = None  # [D] float32: the RMSNorm of each head of q before rotary (Qwen3), or None
    k_norm: np.ndarray | None = None  # [D] ... of k
    input_norm_bias: np.ndarray | None = None  # [H] float32: LayerNorm's bias (GPT-2: the norms are LayerNorm), or None
    post_norm_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None  # [H] float32: biases added after the o, gate_up and down products, or None
    gate_up_bias: np.ndarray | None = None  # [2 I, or I where the MLP is ungated]
    down_bias: np.ndarray | None = None  # [H]

    @property
    def qkv_rows(self) -> int:
        """Rows of the whole packed q/k/v product."""
        return len(self.qkv) + (0 if self.qkv_v is None else len(self.qkv_v))


@dataclass
class NativeWeights:
    embedding: np.ndarray | None  # [V, H] float32 (q41) or rows; None where the head holds it (tied weights)
    layers: list
    final_norm: np.ndarray  # [H]
    head: np.ndarray  # [V, H / 32] of BLOCK8
    cos: np.ndarray | None  # [positions, D / 2]; None where the model learns its positions
    sin: np.ndarray | None
    epsilon: float
    scale: float  # attention scores' scale
    layout: LayoutName = LayoutName.Q41  # a key of specdec.weight_kinds.WEIGHT_LAYOUTS
    window: int = 0  # keys a query sees, its own included (a sliding window), or 0: every earlier key
    final_norm_bias: np.ndarray | None = None  # [H]: LayerNorm's bias (GPT-2), or None
    positions: np.ndarray | None = None  # [positions, H]: learned positions added to the embedding (GPT-2), or None
    activation: str = Activation.SILU_GATED  # the MLP's
    family: FamilyRecord = FamilyRecord()  # what its layers do (the record export wrote; the fields above agree)

    @property
    def max_position(self) -> int:
        """Positions the tables hold (rotary, or learned): every position must be below this."""
        return len(self.cos if self.positions is None else self.positions)

    @property
    def gated(self) -> bool:
        """Whether the MLP is SiLU(gate)·up (gate_up holds 2 I rows), else GELU of one up product (I rows)."""
        return self.activation == Activation.SILU_GATED

    @property
    def vocab(self) -> int:
        """Token ids the embedding holds."""
        return len(self.head) if self.embedding is None else len(self.embedding)

    @property
    def mlp_width(self) -> int:
        down = self.layers[0].down  # [H, I / 32] blocks or [H, I] rows
        return down.shape[1] * WEIGHT_LAYOUTS[self.layout].per


@dataclass
class DraftWeights:
    pairs: list  # per layer [qkv, o, gate_up, down] of BLOCK4P
    head: np.ndarray  # [V', H / 32] of BLOCK8: the rows the draft scores
    head_rows: np.ndarray | None  # [V'] token ids of those rows, None where the head is whole
    fill: float  # the logit of every other token


def _tensors(root: Path, record: NativeRecord, role: str, pages: str) -> dict:
    kinds = {spec.get("kind") for spec in record.tensors.values() if isinstance(spec, dict)}
    try:
        check_format(record.abi, kinds, f"{record.path} (the {role}'s)")
    except ValueError as exc:
        raise BackendError(str(exc), HINT) from None
    try:
        tensors = read_tensors(root / record.path, index_from(record.tensors), pages)
        check_values(root / record.path, tensors)
        return tensors
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise BackendError(f"the {role}'s native weights {record.path} cannot be read: {exc}", HINT) from exc


def check_file(root: Path, record: NativeRecord | None, role: str) -> None:
    """BackendError where the native weights file is padded or cut short (its size against its header's: two small
    reads), so load(verify=True) refuses it before hashing it; ManifestError where it is not a regular file."""
    if record is None or not os.path.lexists(root / record.path):  # missing: the hash check says so
        return
    try:
        check_extent(root / record.path)
    except (ValueError, OSError) as exc:
        raise BackendError(f"the {role}'s native weights {record.path} cannot be read: {exc}", HINT) from exc


# The largest |value| a float the kernels read may hold. LIMIT, float16's largest, for block scales and minima, biases,
# learned positions and rotary tables: a GGUF keeps every block's scale and minimum in fp16 (a K-quant's 6-bit
# sub-block scales multiply them, for weights no model comes near), and the biases and positions of the checkpoints
# export reads run in fp16 or bf16 elsewhere. GAIN_LIMIT for norm gains, which scale a row of unit RMS: a checkpoint's
# are of order 1 (the default model's largest is 3.4, at most 15 times its vector's median), so 1e4 leaves three
# orders of magnitude and refuses a gain that drowns every other input of the head (the default model's final norm
# with one gain of 1e4 prints one token over and over). A value past either is damage or an edit: one flipped high
# exponent bit multiplies a scale by 2**64 or 2**128, and a gain near float32's limit turns every logit to NaN. The
# checks do not see an edit within them (one gain of 100 still changes the text): that is the hash's job.
LIMIT, GAIN_LIMIT = 65504.0, 1e4
BOUNDS = {**dict.fromkeys(("input_norm", "post_norm", "final_norm", "q_norm", "k_norm"), GAIN_LIMIT),
          **dict.fromkeys(("input_norm_bias", "post_norm_bias", "final_norm_bias", "qkv_bias", "o_bias", "gate_up_bias",
                           "down_bias", "positions", "cos", "sin"), LIMIT)}  # a tensor's name past "layers.{i}."
SCALES = ("d", "m")  # the float32 fields of blk4, blk5, blk8 and blk6 (blk4p's h is fp16: bounded by its format)
_CHECKED = {}  # (path, size, mtime) of each weights file found sound in this process: checked once


def check_values(path: Path, tensors: dict) -> None:
    """ValueError naming the first tensor that holds NaN or inf where the kernels read a float, or a value past its
    bound: a block's scale or minimum, a bias, position or rotary value beyond ±LIMIT, a norm gain beyond ±GAIN_LIMIT
    (once per file and version per process)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _CHECKED:
        return
    for name, array in tensors.items():
        fields = [field for field in SCALES if field in (array.dtype.names or ())]
        bound = LIMIT if fields else BOUNDS.get(name.rpartition(".")[2]) if array.dtype == np.float32 else None
        if bound is None and nonfinite(array):  # rows, embeddings, blk4p's fp16 scales: finite, of any size
            raise ValueError(f"tensor {name} holds NaN or inf")
        parts = ([(f" (its blocks' {f})", array[f]) for f in fields] or [("", array)]) if bound else []
        for where, values in parts:
            top = largest(values)
            if not np.isfinite(top):
                raise ValueError(f"tensor {name} holds NaN or inf{where}")
            if top > bound:
                raise ValueError(f"tensor {name} holds {top:.4g}{where}, beyond ±{bound:g}: no model's weights come "
                                 "near it")
    _CHECKED[key] = True


def largest(values: np.ndarray) -> float:
    """The largest |value| of a float32 array (NaN where one is NaN, inf where one is infinite), a chunk at a time
    through one buffer."""
    flat = np.ascontiguousarray(values).reshape(-1)
    out, top = np.empty(min(CHUNK, flat.size), np.float32), 0.0
    for start in range(0, flat.size, CHUNK):
        part = out[: min(CHUNK, flat.size - start)]
        most = float(np.abs(flat[start : start + CHUNK], out=part).max())  # NaN where one is
        if np.isnan(most):
            return most
        top = max(top, most)
    return top


def _expect(tensors: dict, name: str, kind: np.dtype | tuple, shape: tuple, role: str) -> np.ndarray:
    """tensors[name], checked to be of `kind` (or one of a tuple of kinds) and `shape`."""
    array = tensors.get(name)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if array is None or array.dtype not in kinds or array.shape != shape:
        seen = "missing" if array is None else f"{array.dtype} {list(array.shape)}"
        raise BackendError(f"the {role}'s native tensor {name} is {seen}; its dims need {kind} {list(shape)}", HINT)
    return array


def family_of(record: NativeRecord) -> FamilyRecord:
    """A target's family facts: the record export wrote, or for a bundle written before it, its record's fields and
    which tensors its index names (the file's own table agrees with the index: read_tensors)."""
    if record.family is not None:
        return record.family
    names = set(record.tensors)
    return FamilyRecord(norm=NormKind.LAYER if "final_norm_bias" in names else NormKind.RMS,
                        positions=PositionKind.LEARNED if "positions" in names else PositionKind.ROTARY,
                        activation=record.activation, biases=[n for n in LINEARS if f"layers.0.{n}_bias" in names],
                        qk_norm="layers.0.q_norm" in names, window=record.window, epsilon=record.epsilon,
                        scale=record.scale)


def _check_family(family: FamilyRecord, t: dict) -> None:
    """BackendError where the family's facts are not ones this engine reads, or the file's tensors say otherwise."""
    kinds = ((family.norm, NormKind), (family.positions, PositionKind), (family.activation, Activation))
    if any(value not in set(kind) for value, kind in kinds) or not set(family.biases) <= set(LINEARS):
        raise BackendError(f"the target's family record {family} names what this engine does not run", HINT)
    held = {"LayerNorm biases": "final_norm_bias" in t, "learned positions": "positions" in t,
            "q/k norms": "layers.0.q_norm" in t, **{f"{n} biases": f"layers.0.{n}_bias" in t for n in LINEARS}}
    said = {"LayerNorm biases": family.norm == NormKind.LAYER, "learned positions":
            family.positions == PositionKind.LEARNED, "q/k norms": family.qk_norm,
            **{f"{n} biases": n in family.biases for n in LINEARS}}
    wrong = [name for name in held if held[name] != said[name]]
    if wrong:
        raise BackendError(f"the target's family record and its weights file disagree on {', '.join(wrong)} (the "
                           "record says " + ", ".join(f"{n} {'yes' if said[n] else 'no'}" for n in wrong) + ")", HINT)


def _layer_shapes(t: dict, family: FamilyRecord, dims: ModelDims, per: int, linear) -> dict:
    """{name: (shape, kind)} of every layer's tensors as the family and layout say."""
    f32, H, D = np.dtype("<f4"), dims.hidden_size, dims.head_dim
    qkv, width = (dims.num_heads + 2 * dims.num_kv_heads) * D, dims.num_heads * D
    down = t.get("layers.0.down")
    mlp = (down.shape[1] if down is not None and down.ndim == 2 else 0) * per
    up = (2 if family.activation == Activation.SILU_GATED else 1) * mlp
    shapes = {"input_norm": ((H,), f32), "post_norm": ((H,), f32), "qkv": ((qkv, H // per), linear),
              "o": ((H, width // per), linear), "gate_up": ((up, H // per), linear),
              "down": ((H, mlp // per), linear)}
    sizes = {"qkv": qkv, "o": H, "gate_up": up, "down": H}
    shapes.update({f"{name}_bias": ((sizes[name],), f32) for name in family.biases})
    if family.norm == NormKind.LAYER:
        shapes["input_norm_bias"], shapes["post_norm_bias"] = ((H,), f32), ((H,), f32)
    if family.qk_norm:
        shapes["q_norm"], shapes["k_norm"] = ((D,), f32), ((D,), f32)
    return shapes


def target_weights(root: Path, record: NativeRecord, dims: ModelDims, pages: str = Pages.SHARED) -> NativeWeights:
    """The weights of a target (layout "q41", "q80" or "mixed", or rows), each tensor's kind and shape checked against
    `dims` and its family record."""
    t = _tensors(root, record, "target", pages)
    family = family_of(record)
    _check_family(family, t)
    f32, rows, layout = np.dtype("<f4"), WEIGHT_LAYOUTS[record.layout].rows, WEIGHT_LAYOUTS[record.layout]
    H, D, V = dims.hidden_size, dims.head_dim, dims.vocab_size
    learned = family.positions == PositionKind.LEARNED
    table, columns = ("positions", H) if learned else ("cos", D // 2)
    cos = t.get(table)
    if cos is None or cos.ndim != 2 or cos.shape[1] != columns or cos.dtype != f32:
        raise BackendError(f"the target's {table} table is {None if cos is None else list(cos.shape)}, not "
                           f"[positions, {columns}] f32", HINT)
    mixed = tuple(kind.dtype for kind in MIXED_KINDS)  # each weight of its own kind (None in the layout)
    per, linear = layout.per, mixed if layout.linear is None else layout.linear.dtype
    head_kind = mixed if layout.head is None else layout.head.dtype
    shapes, qkv = _layer_shapes(t, family, dims, per, linear), (dims.num_heads + 2 * dims.num_kv_heads) * D
    layer_list = []
    for i in range(dims.num_layers):
        own = dict(shapes)
        if layout.mixed and t.get(f"layers.{i}.qkv_v") is not None:  # q/k rows and v rows apart
            own["qkv"] = ((qkv - dims.num_kv_heads * D, H // per), linear)
            own["qkv_v"] = ((dims.num_kv_heads * D, H // per), linear)
        layer_list.append(Layer(**{name: _expect(t, f"layers.{i}.{name}", kind, shape, "target")
                                   for name, (shape, kind) in own.items()}))
    embedding = t.get("embedding")
    if embedding is not None:
        _expect(t, "embedding", head_kind if rows else f32, (V, H), "target")
    layer_norm = family.norm == NormKind.LAYER
    return NativeWeights(embedding=embedding, layers=layer_list, final_norm=_expect(t, "final_norm", f32, (H,), "target"),
                         head=_expect(t, "head", head_kind, (V, H // per), "target"),
                         cos=None if learned else cos, sin=None if learned else _expect(t, "sin", f32, cos.shape, "target"),
                         epsilon=family.epsilon, scale=family.scale, layout=record.layout, window=family.window,
                         final_norm_bias=_expect(t, "final_norm_bias", f32, (H,), "target") if layer_norm else None,
                         positions=cos if learned else None, activation=family.activation, family=family)


def draft_weights(root: Path, record: NativeRecord, dims: ModelDims, target: NativeWeights,
                  pages: str = Pages.SHARED) -> DraftWeights:
    """The "q41-draft" weights of an int4-q41 draft of `target`."""
    t = _tensors(root, record, "draft", pages)
    pairs, per, draft = [], WEIGHT_LAYOUTS[target.layout].per, WEIGHT_LAYOUTS[record.layout]
    for i, layer in enumerate(target.layers):
        shapes = [(layer.qkv_rows, layer.qkv.shape[1])] + [getattr(layer, name).shape for name in LINEARS[1:]]
        # [N, K / 32] blocks or [N, K] rows; a mixed layer's q/k/v whole, its v rows apart or not
        pairs.append([_expect(t, f"layers.{i}.{name}_p", draft.linear.dtype, (n, draft.linear.elements(k * per)),
                              "draft")
                      for name, (n, k) in zip(LINEARS, shapes)])
    rows = t.get("head_rows")
    scored = len(rows) if rows is not None else dims.vocab_size
    head = _expect(t, "head", draft.head.dtype, (scored, draft.head.elements(dims.hidden_size)), "draft")
    if rows is not None and (rows.dtype != np.int64 or rows.ndim != 1 or (rows.size and not (
            rows.min() >= 0 and rows.max() < dims.vocab_size and len(np.unique(rows)) == len(rows)))):
        raise BackendError("the draft's head_rows are not distinct token ids of its vocabulary", HINT)
    return DraftWeights(pairs=pairs, head=head, head_rows=rows, fill=record.fill)


def check_layout(record: NativeRecord | None, role: str, note: str = "") -> NativeRecord:
    """The record, where it is one this engine reads for `role`; BackendError otherwise (`note`: why export wrote
    none, as the manifest says)."""
    if record is None:
        why = (f": {note}" if note else " (specdec-export writes them for LLaMA-layout gqa targets, and calibrate "
               "quantize for their int4-q41 drafts)")
        raise BackendError(f"the bundle's {role} carries no native weights{why}", HINT)
    layout = WEIGHT_LAYOUTS.get(record.layout)
    if layout is None or layout.role != role:
        raise BackendError(f"the {role}'s native weights have layout {record.layout!r}, which this engine does not "
                           f"run for a {role}", HINT)
    return record


def drafts_natively(draft: ModelEntry, target: ModelEntry) -> bool:
    """Whether `draft` is the target's Q4_1 quantization with native weights, which the native backend runs on the
    target's blocks."""
    return (draft.derived == Method.INT4_Q41 and draft.native is not None and draft.dims == target.dims
            and draft.lowering == target.lowering and draft.max_seq_len == target.max_seq_len
            and draft.max_batch <= target.max_batch)
