"""onnx_from_hf: trace the static-KV decoder with torch.onnx (dynamo) into one graph for every B and T."""
from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch

from specdec.errors import ExportError
from specdec.export.architectures import Architecture
from specdec.export.gqa import GqaDecoder, gqa_translation, move_to_target_domains
from specdec.export.static_model import StaticKVDecoder
from specdec.lowering import lowering_for
from specdec.manifest import Dtype, LoweringName, Precision

log = logging.getLogger(__name__)

OPSET = 18
TORCH_DTYPES = {Precision.FP32: torch.float32, Precision.FP16: torch.float16, Precision.BF16: torch.bfloat16}
KV_DTYPE_NAMES = {Precision.FP32: Dtype.FLOAT32, Precision.FP16: Dtype.FLOAT16, Precision.BF16: Dtype.BFLOAT16}


def example_inputs(arch: Architecture, max_seq_len: int, dtype: torch.dtype, batch: int = 2, steps: int = 3):
    # T >= 2 and B >= 2 in the example, so neither is baked into the graph as a constant
    dims = arch.dims
    kv_shape = (dims.num_layers, batch, dims.num_kv_heads, max_seq_len, dims.head_dim)
    return (
        torch.zeros(batch, steps, dtype=torch.long),
        torch.zeros(batch, dtype=torch.long),
        torch.zeros(kv_shape, dtype=dtype),
        torch.zeros(kv_shape, dtype=dtype),
    )


def _plain_program(arch: Architecture, max_seq_len: int, batch, tokens, dtype: torch.dtype, features: tuple):
    args = example_inputs(arch, max_seq_len, dtype)
    shapes = {"input_ids": {0: batch, 1: tokens}, "cache_len": {0: batch}, "past_keys": {1: batch},
              "past_values": {1: batch}}
    inputs, outputs = lowering_for(LoweringName.PLAIN).io_names(arch.dims.num_layers, bool(features))
    return StaticKVDecoder(arch, max_seq_len, features).eval(), args, shapes, inputs, outputs, None


def _gqa_program(arch: Architecture, max_seq_len: int, batch, tokens, dtype: torch.dtype, features: tuple):
    ids, cache_len, keys, values = example_inputs(arch, max_seq_len, dtype)
    layers = arch.dims.num_layers
    args = (ids, cache_len, torch.arange(ids.shape[1]), list(keys), list(values))
    shapes = {"input_ids": {0: batch, 1: tokens}, "cache_len": {0: batch},
              "logit_positions": {0: torch.export.Dim("logits", min=1, max=max_seq_len)},
              "past_keys": [{0: batch}] * layers, "past_values": [{0: batch}] * layers}
    inputs, outputs = lowering_for(LoweringName.GQA).io_names(layers, bool(features))
    return GqaDecoder(arch, max_seq_len, features).eval(), args, shapes, inputs, outputs, gqa_translation()


# lowering -> traced module and its I/O
PROGRAMS = {LoweringName.PLAIN: _plain_program, LoweringName.GQA: _gqa_program}
# torch.onnx's op registry warns at WARNING that torchvision is missing (nms, roi_align, ...): ops no causal LM uses,
# which users read as errors of the export
REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def _quiet(name: str):
    """The logger `name` at ERROR while the block runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)



def onnx_from_hf(arch: Architecture, max_seq_len: int, max_batch: int, dtype: str, path: Path,
                 lowering: LoweringName = LoweringName.PLAIN, feature_layers: tuple = ()) -> Path:
    """Write `path` (+ `path.data` external weights) for `arch`'s model, with a features output of `feature_layers`
    where given; returns the path."""
    batch = torch.export.Dim("batch", min=1, max=max(2, max_batch))
    tokens = torch.export.Dim("tokens", min=1, max=max_seq_len)
    module, args, shapes, inputs, outputs, table = PROGRAMS[lowering](arch, max_seq_len, batch, tokens,
                                                                      TORCH_DTYPES[dtype], tuple(feature_layers))
    try:
        with warnings.catch_warnings(), torch.no_grad(), _quiet(REGISTRY_LOGGER):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, input_names=inputs, output_names=outputs, dynamic_shapes=shapes, dynamo=True,
                opset_version=OPSET, verbose=False, custom_translation_table=table,
            )
    except Exception as exc:  # torch.export raises many unrelated types; report them all the same way
        raise ExportError(
            f"torch.onnx.export failed for {arch.dims.model_type}: {type(exc).__name__}: {str(exc)[:500]}",
            "run with -v for the full trace; this architecture may need a quirk class in specdec/export/architectures.py",
        ) from exc
    if lowering_for(lowering).contrib_ops:
        move_to_target_domains(program.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=True)
    return path
