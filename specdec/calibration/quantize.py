"""Quantization methods: an fp32 static-KV graph -> a quantized graph for a bundle's draft or target.

| method        | precision | kind                                         | back ends              |
| int4-rtn      | int4      | MatMulNBits, round to nearest (block 32)     | onnxruntime            |
| int4-hqq      | int4      | MatMulNBits, half-quadratic (data-free)      | onnxruntime            |
| int4-gptq     | int4      | MatMulNBits, GPTQ with calibration data      | onnxruntime            |
| int4-q41      | int4      | MatMulNBits on a Q4_1 grid + float-min term  | onnxruntime            |
| int8-qdq      | int8-qdq  | quantize_static Q/DQ, MinMax, per channel¹   | onnxruntime, tensorrt  |
| modelopt-int8 | int8-qdq  | NVIDIA ModelOpt Q/DQ (calibrated on CPU)     | onnxruntime, tensorrt  |
| modelopt-fp8  | fp8-qdq   | NVIDIA ModelOpt FP8 Q/DQ                     | tensorrt               |

¹ MLP down projections stay fp32 (activation outliers); see _int8_static.
"""
from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specdec.calibration.data import DataConfig
from specdec.calibration.q41 import MINIMUMS, Minimum
from specdec.errors import ConfigError, missing_dependency
from specdec.lowering import lowering_for
from specdec.manifest import Method, Precision, Role
from specdec.runtime.config import BackendName

log = logging.getLogger(__name__)

BLOCK = 32
ACCURACY_LEVEL = 4


METHODS = {  # method -> (manifest precision, needs calibration data)
    Method.INT4_RTN: (Precision.INT4, False), Method.INT4_HQQ: (Precision.INT4, False),
    Method.INT4_GPTQ: (Precision.INT4, True), Method.INT4_Q41: (Precision.INT4, False),
    Method.INT8_QDQ: (Precision.INT8_QDQ, True), Method.MODELOPT_INT8: (Precision.INT8_QDQ, True),
    Method.MODELOPT_FP8: (Precision.FP8_QDQ, True),
}
@dataclass(frozen=True)
class QuantTarget:
    """A back end a quantized graph is made for: the methods it runs, and what its kernels take."""

    name: BackendName
    methods: tuple
    zero_points: bool  # asymmetric (uint8 + zero point) activations; TensorRT takes symmetric int8 only
    standard_onnx: bool  # reads standard ONNX only (no onnxruntime contrib ops)


QUANT_TARGETS = {target.name: target for target in (
    QuantTarget(BackendName.ONNXRUNTIME, (Method.INT4_RTN, Method.INT4_HQQ, Method.INT4_GPTQ, Method.INT4_Q41,
                                          Method.INT8_QDQ, Method.MODELOPT_INT8), True, False),
    QuantTarget(BackendName.TENSORRT, (Method.INT8_QDQ, Method.MODELOPT_INT8, Method.MODELOPT_FP8), False, True),
)}
BACKENDS = {name: target.methods for name, target in QUANT_TARGETS.items()}
ROLES = (Role.DRAFT.value, Role.TARGET.value)  # plain strings: argparse prints them


@dataclass(frozen=True)
class QuantizeConfig:
    method: str
    role: Role = Role.DRAFT  # which model of the new bundle the quantized graph becomes
    backend: BackendName = BackendName.ONNXRUNTIME  # the back end that will run it
    data: DataConfig = field(default_factory=DataConfig)
    verify_len: int = 5  # T of the verify-shaped calibration feeds (γ + 1)
    accuracy_level: int = ACCURACY_LEVEL  # MatMulNBits compute: 4 = int8 (fast on x86), 1 = fp32 (exact)
    head_tokens: int = 0  # int4-q41 drafts: an LM head over this many tokens (0: the whole vocabulary)
    q41_minimum: str | None = None  # int4-q41: "rows" (None: the default) or "exact" (specdec.calibration.q41)
    progress: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"quantization method {self.method!r} is unknown", f"choose one of {', '.join(METHODS)}")
        if self.role not in ROLES:
            raise ConfigError(f"role {self.role!r} is unknown", "use --role draft or --role target")
        if self.backend not in BACKENDS:
            raise ConfigError(f"back end {self.backend!r} is unknown", f"choose one of {', '.join(BACKENDS)}")
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "backend", BackendName(self.backend))
        if self.method not in BACKENDS[self.backend]:
            others = [b for b, methods in BACKENDS.items() if self.method in methods]
            raise ConfigError(
                f"{self.precision} ({self.method}) is not supported by the {self.backend} back end",
                f"for {self.backend} use one of {', '.join(BACKENDS[self.backend])}; "
                f"{self.method} runs on {', '.join(others)}",
            )
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConfigError(f"accuracy_level {self.accuracy_level} is not 0..4", "use 4 (int8) or 1 (fp32)")
        if self.head_tokens < 0 or (self.head_tokens and (self.method != Method.INT4_Q41 or self.role != Role.DRAFT)):
            raise ConfigError(f"--head-tokens {self.head_tokens} with {self.method} for the {self.role}",
                              "a trimmed LM head is for int4-q41 drafts only (--method int4-q41 --role draft), "
                              "and counts tokens (>= 1)")
        if self.q41_minimum is not None and (self.method != Method.INT4_Q41 or self.q41_minimum not in MINIMUMS):
            raise ConfigError(f"--q41-minimum {self.q41_minimum} with {self.method}",
                              f"it is for --method int4-q41 only, one of {', '.join(MINIMUMS)}")

    @property
    def precision(self) -> Precision:
        return METHODS[self.method][0]

    @property
    def needs_data(self) -> bool:
        return METHODS[self.method][1]


def check_lowering(config: QuantizeConfig, lowering: str) -> None:
    """TensorRT and ModelOpt read standard ONNX only: a lowering with onnxruntime contrib ops (gqa) stops them."""
    lowering_for(lowering).check_quantization(config.method, config.backend, QUANT_TARGETS[config.backend].standard_onnx)


def _gptq_block(model) -> int:
    """Block size for onnxruntime's GPTQ, whose zero-point packing fails when K / block is odd: 32, else 16."""
    inits = {init.name: init for init in model.graph.initializer}
    ks = [inits[n.input[1]].dims[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    for block in (BLOCK, 16):
        if all(k % block == 0 and (k // block) % 2 == 0 for k in ks):
            return block
    raise ConfigError(f"GPTQ cannot quantize MatMuls with K = {sorted(set(ks))} (K / 16 must be even)",
                      "use --method int4-rtn or int4-hqq for this model")


def _matmul_nbits(source: Path, dest: Path, algo_config, accuracy_level: int) -> int:
    try:
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import GPTQWeightOnlyQuantConfig, MatMulNBitsQuantizer
    except ImportError as exc:
        raise missing_dependency("onnxruntime", "cpu") from exc
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(str(source))
    block = _gptq_block(model) if isinstance(algo_config, GPTQWeightOnlyQuantConfig) else BLOCK
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=False,
                                     accuracy_level=accuracy_level, algo_config=algo_config)
    quantizer.process()
    dest.parent.mkdir(parents=True, exist_ok=True)
    quantizer.model.save_model_to_file(str(dest), use_external_data_format=True)
    return block


def _int4(source: Path, dest: Path, config: QuantizeConfig, reader, head_keep=None) -> dict:
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    if config.method == Method.INT4_Q41:
        from specdec.calibration.q41 import q41_from_onnx

        return q41_from_onnx(source, dest, config.progress, config.accuracy_level, head_keep=head_keep,
                             minimum=config.q41_minimum or Minimum.ROWS)
    algo = None
    if config.method == Method.INT4_HQQ:
        algo = nbits.HQQWeightOnlyQuantConfig(block_size=BLOCK, bits=4)
    elif config.method == Method.INT4_GPTQ:
        algo = nbits.GPTQWeightOnlyQuantConfig(calibration_data_reader=reader, percdamp=0.01, block_size=128)
    return {"block_size": _matmul_nbits(source, dest, algo, config.accuracy_level)}


def mlp_output_matmuls(model) -> list[str]:
    """MatMuls whose activation is a product of two computed tensors (SwiGLU's act(gate) * up, GELU's x * (1 + tanh)):
    the MLP down projections. A norm's last Mul has a constant weight, so it does not count. Their inputs carry
    outliers (SmolLM2: max |x| up to 2365 where the 99.9th percentile is 14), which one 8-bit scale cannot hold."""
    constants = {init.name for init in model.graph.initializer}
    constants |= {out for node in model.graph.node if node.op_type == "Constant" for out in node.output}
    producers = {out: node for node in model.graph.node for out in node.output}

    def computed_product(name: str) -> bool:
        node = producers.get(name)
        return node is not None and node.op_type == "Mul" and not constants & set(node.input)

    return [node.name for node in model.graph.node if node.op_type == "MatMul" and computed_product(node.input[0])]


def _int8_static(source: Path, dest: Path, reader, backend: str) -> dict:
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    model = onnx.load(str(source))
    kept = mlp_output_matmuls(model)
    # onnxruntime: uint8 asymmetric activations x int8 weights in 7 bits. Full-range int8 weights overflow the
    # u8s8 int16 accumulation of AVX2 CPUs without VNNI: there one such layer alone costs a visible share of top-1
    # agreement (`specdec calibrate report BUNDLE` measures it).
    # TensorRT: int8 symmetric activations (it supports no zero point), full-range weights.
    trt = not QUANT_TARGETS[backend].zero_points
    quantize_static(  # a ModelProto, not a path: given a path, quantize_static writes model-inferred.onnx beside it
        model, str(dest), reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
        nodes_to_exclude=kept, per_channel=True, reduce_range=not trt,
        activation_type=QuantType.QInt8 if trt else QuantType.QUInt8, weight_type=QuantType.QInt8,
        use_external_data_format=True, calibrate_method=CalibrationMethod.MinMax,
        extra_options={"MatMulConstBOnly": True, "ActivationSymmetric": trt,
                       "OpTypesToExcludeOutputQuantization": ["MatMul"]},  # outputs feed the fp32 residual stream
    )
    activations = "int8 symmetric" if trt else "uint8 asymmetric"
    return {"activations": f"{activations} per tensor (MinMax), MatMul inputs only",
            "weights": "int8 per channel" + ("" if trt else ", 7-bit range (reduce_range)"),
            "ops": "MatMul (constant B)", "kept_fp32": f"{len(kept)} MLP down projections (activation outliers)"}


@contextlib.contextmanager
def _ort_quantization_restored():
    """ModelOpt rebinds onnxruntime.quantization's calibrators and QDQ quantizer for the rest of the process
    (modelopt.onnx.quantization.ort_patching); put them back, so int8-qdq and int4-gptq still work afterwards."""
    from onnxruntime.quantization import base_quantizer, calibrate, qdq_quantizer

    owners = (calibrate.MinMaxCalibrater, calibrate.HistogramCalibrater, calibrate.HistogramCollector,
              calibrate.CalibraterBase, qdq_quantizer.QDQQuantizer, base_quantizer.BaseQuantizer)
    saved = [(owner, dict(vars(owner))) for owner in owners]
    create_calibrator = calibrate.create_calibrator
    try:
        yield
    finally:
        calibrate.create_calibrator = create_calibrator
        for owner, attributes in saved:
            for name, value in attributes.items():
                if name not in ("__dict__", "__weakref__") and vars(owner).get(name) is not value:
                    setattr(owner, name, value)


def _modelopt(source: Path, dest: Path, mode: str, reader) -> dict:
    try:
        import modelopt
        import onnx
        from modelopt.onnx.quantization import quantize as modelopt_quantize
    except ImportError as exc:
        raise missing_dependency("modelopt", "modelopt") from exc
    with scratch_dir(dest.parent) as scratch, _ort_quantization_restored():
        copy = Path(scratch) / "source.onnx"  # ModelOpt shape-infers its input file in place: never the bundle's
        model = onnx.load(str(source))
        kept = mlp_output_matmuls(model)  # node names, as anchored regular expressions
        onnx.save(model, str(copy), save_as_external_data=True, location=copy.name + ".data")
        modelopt_quantize(str(copy), quantize_mode=mode, calibration_data_reader=reader, calibration_eps=["cpu"],
                          calibration_method="entropy", op_types_to_quantize=["MatMul"],
                          nodes_to_exclude=[f"^{re.escape(name)}$" for name in kept], dq_only=True,
                          use_external_data_format=True, output_path=str(dest), high_precision_dtype="fp32",
                          log_level="WARNING")
    return {"tool": f"nvidia-modelopt {modelopt.__version__}", "mode": mode, "ops": "MatMul",
            "calibration": "entropy (per-tensor activations), per-channel weights stored quantized (DQ only)",
            "kept_fp32": f"{len(kept)} MLP down projections (activation outliers)"}


def quantize_onnx(source: Path, dest: Path, config: QuantizeConfig, reader=None, head_keep=None) -> dict:
    """Quantize the fp32 graph `source` into `dest` (+ external data). `reader` feeds data-aware methods; head_keep:
    the token ids of a trimmed int4-q41 head (config.head_tokens). -> method details for the manifest."""
    if config.needs_data and reader is None:
        raise ConfigError(f"{config.method} needs calibration data", "pass a StaticKVReader (--data)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in (dest, dest.with_name(dest.name + ".data"), dest.with_name(dest.name + "_data")):  # _data: ModelOpt
        stale.unlink(missing_ok=True)
    log.info("quantizing %s with %s", source, config.method)
    if config.precision == Precision.INT4:
        return _int4(source, dest, config, reader, head_keep)
    if config.method == Method.INT8_QDQ:
        return _int8_static(source, dest, reader, config.backend)
    return _modelopt(source, dest, config.method.split("-", 1)[1], reader)


def scratch_dir(near: Path) -> tempfile.TemporaryDirectory:
    """A temporary directory beside `near` (same file system: quantizers write large files)."""
    return tempfile.TemporaryDirectory(prefix=".calibrate.", dir=near)
