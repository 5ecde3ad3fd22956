"""Drafts derived from the target, for targets with no smaller sibling."""
from __future__ import annotations

import logging
from pathlib import Path

from specdec.errors import ExportError, missing_dependency
from specdec.export.architectures import Architecture
from specdec.lowering import FEATURES

log = logging.getLogger(__name__)

INT4_BLOCK_SIZE = 32
INT4_ACCURACY_LEVEL = 4  # int8 compute in MatMulNBits: the fast path on x86 CPUs


def layer_draft_range(total: int, count: int) -> None:
    if not 1 <= count < total:
        raise ExportError(
            f"--draft-layers {count} is out of range for a target with {total} layers",
            f"pass a value from 1 to {total - 1}",
        )


def layer_draft(arch: Architecture, count: int) -> Architecture:
    """The target's first `count` layers + final norm + LM head, weights shared (tied weights stay tied)."""
    layer_draft_range(arch.dims.num_layers, count)
    return arch.with_layers(count)


def int4_from_onnx(source: Path, dest: Path) -> Path:
    """Quantize every constant-weight MatMul of `source` to 4-bit MatMulNBits (block 32), written to `dest`."""
    try:
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:
        raise missing_dependency("onnxruntime", "cpu") from exc
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(str(source))
    kept = [output for output in model.graph.output if output.name != FEATURES]  # a draft returns logits and KV
    del model.graph.output[:]
    model.graph.output.extend(kept)
    quantizer = MatMulNBitsQuantizer(
        model, bits=4, block_size=INT4_BLOCK_SIZE, is_symmetric=False, accuracy_level=INT4_ACCURACY_LEVEL
    )
    quantizer.process()
    dest.parent.mkdir(parents=True, exist_ok=True)
    quantizer.model.save_model_to_file(str(dest), use_external_data_format=True)
    return dest
