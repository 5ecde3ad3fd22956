"""The native engine's weights, written into a bundle (specdec.blocks): read once from the model's family
(specdec.export.native_family: the same modules the gqa lowering traces), fitted onto the GGUF grids and checked there,
so that the runtime only reads them.

Where every linear weight lies on a Q4_1 grid (or every one on a Q8_0 grid, or each on one of a K-quant file's grids)
and the head on a Q8_0 grid (a GGUF's, exported), the weights keep those blocks and the kernels compute the graph's
own function. Weights off those grids are kept in the narrowest of bf16, f16 and fp32 that holds every one exactly (a
bf16 checkpoint exported to fp32 keeps 2 bytes a weight): the same function again. A model outside the engine's
layouts, or with a NaN or inf weight, gets no native weights (NativeSkipped).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.blocks import (BLOCK4, BLOCK8, GridError, float_rows, head_holds, mixed_blocks, on_grid, q41_blocks,
                            q41_pairs, q8_blocks, row_precision, rows_of)
from specdec.export.native_family import NativeSkipped, read_family
from specdec.manifest import NativeRecord
from specdec.weight_kinds import LayoutName
from specdec.weights_file import FORMAT_VERSION, write_tensors
from specdec.native.weights import LINEARS

TARGET_FILE, DRAFT_FILE = "native.bin", "native.bin"  # in the model's folder


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


def native_tensors(arch, max_seq_len: int) -> tuple[LayoutName, dict, dict]:
    """(layout, its tensors (specdec.native.weights), the record's fields: its family) of `arch`'s model;
    NativeSkipped where it is outside the engine's layouts or a weight is not finite."""
    linears, tensors, family = read_family(arch, max_seq_len)
    head, embedding = tensors.pop("head"), tensors.pop("embedding")
    for name, weight in [*linears.items(), ("head", head), ("embedding", embedding)]:
        if weight.ndim != 2 or weight.shape[1] % 32:
            raise NativeSkipped(f"{name} has shape {list(weight.shape)}; the native kernels need K % 32 == 0")
    dims = arch.dims
    packed = {f"layers.{i}.{LINEARS[0]}": dims.num_kv_heads * dims.head_dim for i in range(dims.num_layers)}  # q/k/v
    grids = _grids(linears, head, embedding, packed) if np.isfinite(embedding).all() else None
    layout, found = grids if grids is not None else _rows(linears, head, embedding)
    tensors.update(found)
    return layout, tensors, {"family": family}


def _record(layout: LayoutName, root: Path, rel: str, tensors: dict, **scalars) -> NativeRecord:
    index = write_tensors(root / rel, tensors)
    return NativeRecord(layout=layout, abi=FORMAT_VERSION, path=rel, tensors={
        name: {"kind": entry.kind, "shape": list(entry.shape), "offset": entry.offset} for name, entry in index.items()},
        **scalars)


def write_target(root: Path, role: str, arch, max_seq_len: int) -> NativeRecord:
    """Write root/role/native.bin of `arch`'s model; NativeSkipped where the engine cannot run it."""
    layout, tensors, scalars = native_tensors(arch, max_seq_len)
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
