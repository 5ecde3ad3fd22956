"""The bundle manifest: the only thing the runtime reads about a bundle (stdlib only).

`manifest_from_json` parses and validates; `json_from_manifest` writes; `check_bundle_files` verifies
hashes. Draft/target agreement (vocabulary, tokenizer) is checked by `validate_manifest`.
"""
from __future__ import annotations

import hashlib
import dataclasses
import json
import math
import numbers
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from specdec.errors import ManifestError
from specdec.files import open_regular, read_regular
from specdec.native_record import ACTIVATIONS, Activations, FamilyRecord, NativeRecord

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class Role(StrEnum):
    """A model's place in a bundle (the keys of `models`). A StrEnum: equal to the name the JSON holds."""

    TARGET = "target"
    DRAFT = "draft"


class Precision(StrEnum):
    """How a model's graph holds its weights (ModelEntry.precision)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8_QDQ = "int8-qdq"
    FP8_QDQ = "fp8-qdq"
    INT4 = "int4"


class Method(StrEnum):
    """A quantization method: how `specdec calibrate quantize` derived a model (ModelEntry.derived names it)."""

    INT4_RTN = "int4-rtn"
    INT4_HQQ = "int4-hqq"
    INT4_GPTQ = "int4-gptq"
    INT4_Q41 = "int4-q41"
    INT8_QDQ = "int8-qdq"
    MODELOPT_INT8 = "modelopt-int8"
    MODELOPT_FP8 = "modelopt-fp8"


MODELOPT_METHODS = frozenset({Method.MODELOPT_INT8, Method.MODELOPT_FP8})  # quantized by NVIDIA ModelOpt


class EngineBackend(StrEnum):
    """What built an engine plan (EngineRecord.backend)."""

    TENSORRT = "tensorrt"


class LoweringName(StrEnum):
    """A lowering of the ONNX contract (ModelEntry.lowering); specdec.lowering.LOWERINGS holds their objects."""

    PLAIN = "plain"  # standard ONNX ops: the reference, TensorRT's input
    GQA = "gqa"  # onnxruntime's GroupQueryAttention, KV in place


class Profile(StrEnum):
    """A TensorRT optimization profile of a plan (EngineRecord.profiles, profile_order: indices 0 and 1)."""

    PREFILL = "prefill"
    STEP = "step"


class HardwareCompatibility(StrEnum):
    """The GPUs a TensorRT plan runs on (EngineRecord.hardware_compatibility; specdec.engines.trt_select)."""

    NONE = "none"  # the compute capability it was built on
    AMPERE_PLUS = "ampere_plus"  # any of compute capability 8.0 or later
    SAME_COMPUTE_CAPABILITY = "same_compute_capability"


class Dtype(StrEnum):
    """The element type of a model's KV and logits (ModelEntry.kv_dtype, logits_dtype)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


ROLES = tuple(role.value for role in Role)  # plain strings: messages and argparse print them
PRECISIONS = tuple(precision.value for precision in Precision)
KV_DTYPES = tuple(dtype.value for dtype in Dtype)
LOWERING_NAMES = tuple(name.value for name in LoweringName)


@dataclass(frozen=True)
class ModelDims:
    """Architecture facts the runtime needs, normalized across model families."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list  # ints for static dims, strings for symbolic ones


@dataclass(frozen=True)
class ParityStep:
    name: str
    batch: int
    tokens: int
    cache_len: int
    max_abs_diff: float
    tolerance: float
    enforced: bool = True  # False for quantized graphs, whose logits differ from fp32 PyTorch by design


@dataclass(frozen=True)
class SourceRecord:
    """Where a model's weights came from."""

    kind: str  # a specdec.export.sources.SourceKind: "directory", "gguf", "hub", "default"
    name: str  # what the user passed, or the default model's name
    path: str = ""
    gguf_file: str | None = None
    revision: str | None = None  # a hub snapshot's commit
    sha256: str | None = None  # of the GGUF file, when there is one


@dataclass(frozen=True)
class EngineRecord:
    """One built TensorRT plan of a model (specdec.engines.trt_config.engine_record writes it)."""

    backend: str  # an EngineBackend
    path: str  # relative to the bundle
    compute_capability: str  # "major.minor"
    tensorrt_version: str
    sha256: str
    profiles: dict  # profile name -> input name -> {"min", "opt", "max"} shapes
    profile_order: list = field(default_factory=lambda: list(Profile))
    version_compatible: bool = False
    hardware_compatibility: str = HardwareCompatibility.NONE
    max_batch: int = 1


@dataclass(frozen=True)
class GammaRecord:
    """A γ calibration (specdec.calibration.gamma): per-position acceptance, c and r(γ) on one machine."""

    gamma: int
    cumulative: list  # A_j, j = 1..γ_max
    alphas: list  # conditional α_j
    cost_ratio: float  # c: draft step / target step
    verify_cost: list  # r(γ), γ = 1..γ_max
    speedups: list
    rounds: int
    verify_cost_used: bool = True
    measured_at: str = ""


@dataclass(frozen=True)
class CalibrationRecord:
    """How a quantized model was made (empty for exported models), and the draft's γ calibration."""

    method: str = ""
    precision: str = ""
    backend: str = ""
    origin: str = ""  # the model it was quantized from
    details: dict = field(default_factory=dict)
    data: dict | None = None  # the calibration data, for methods that use some
    accuracy_level: int | None = None
    gamma: GammaRecord | None = None


@dataclass(frozen=True)
class ModelEntry:
    """One exported model of a bundle (target or draft)."""

    role: str
    source: SourceRecord
    derived: str  # "" or how the model was derived from the target: "int4", "layers:4"
    dims: ModelDims
    max_seq_len: int
    max_batch: int
    precision: str
    kv_dtype: str
    logits_dtype: str
    lowering: str
    onnx_path: str
    files: dict  # relative path -> sha256, every file the graph needs
    inputs: list  # list[TensorSpec]
    outputs: list  # list[TensorSpec]
    parity: list = field(default_factory=list)  # list[ParityStep]
    parity_note: str = ""  # "checked", or why parity was not enforced or not run
    engines: list = field(default_factory=list)  # list[EngineRecord]
    size_bytes: int = 0
    calibration: CalibrationRecord = field(default_factory=CalibrationRecord)
    native: NativeRecord | None = None  # the native engine's weights, where export could write them
    native_note: str = ""  # why export wrote none for this model (its graph outside the native layout), or ""
    sizes: dict = field(default_factory=dict)  # relative path -> bytes of each of `files`, checked before its hash
    # (a padded file is refused without being read whole); {} in bundles written before it
    feature_layers: list = field(default_factory=list)  # the layers whose hidden states the graph's `features`
    # output holds, in its order (none: the graph returns logits and KV only)


@dataclass(frozen=True)
class HeadRecord:
    """A trained draft head (EAGLE-3 style) beside the target (specdec.head): one decoder layer over the target's hidden
    states at `feature_layers` and the next token's embedding (the target's, shared), a trimmed vocabulary."""

    format: int  # specdec.head.format.FORMAT_VERSION of the writer
    path: str  # its weights (numpy .npz), relative to the bundle; also in `files` with its sha256
    files: dict  # relative path -> sha256
    hidden_size: int  # H: the target's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary, which the draft vocabulary maps into
    draft_vocab_size: int  # V': the rows its LM head scores
    feature_layers: list  # the target layers whose outputs it fuses, in its fc's order (outputs of layer l, 0-based)
    epsilon: float  # its RMSNorms'
    norm_before_residual: bool = False  # the fused feature normed before it becomes the residual (a config flag)
    source: str = ""  # where it came from: a checkpoint directory, or how it was made


@dataclass(frozen=True)
class Defaults:
    gamma: int
    gamma_max: int
    max_prefill_chunk: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    activations: str = Activations.FP32  # the native target's (an Activations); a bundle written before it runs fp32


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    eos_token_ids: list
    bos_token_id: int | None
    pad_token_id: int | None
    has_chat_template: bool
    files: dict  # relative path -> sha256


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    specdec_version: str
    tools: dict
    tokenizer: TokenizerInfo
    models: dict  # role -> ModelEntry
    defaults: Defaults
    head: HeadRecord | None = None  # a trained draft head, where the bundle has one

    @property
    def target(self) -> ModelEntry:
        return self.models[Role.TARGET]

    @property
    def draft(self) -> ModelEntry | None:
        return self.models.get(Role.DRAFT)


_NESTED = {cls.__name__: cls for cls in (ModelDims, SourceRecord, CalibrationRecord, GammaRecord, TokenizerInfo,
                                         Defaults, NativeRecord, HeadRecord, FamilyRecord)}  # type name -> dataclass, for nested records


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of `path`, a regular file (specdec.files: a FIFO or a device is refused, never read)."""
    with os.fdopen(open_regular(path), "rb") as handle:
        return _sha256(handle)


def _sha256(handle, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(chunk), b""):
        digest.update(block)
    return digest.hexdigest()


def json_from_manifest(manifest: Manifest) -> str:
    data = asdict(manifest)
    if data["head"] is None:  # a bundle without a head writes the manifest it always did
        del data["head"]
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


def _require(data: dict, key: str, where: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise ManifestError(
            f"manifest field {where}.{key} is missing",
            "the bundle is corrupt or was written by another tool; re-export it with specdec-export",
        )
    return data[key]


_KINDS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,), "dict": (dict,)}
_LEGACY_KEYS = {"from": "origin"}  # manifests of specdec <= 0.1.0 wrote CalibrationRecord.origin as "from"


def _typed(value, annotation: str, where: str):
    """`value` checked against a field annotation such as 'int', 'str | None', 'SourceRecord', 'list'."""
    options = [part.strip() for part in annotation.split("|")]
    if value is None and "None" in options:
        return None
    for option in options:
        if option in _NESTED:
            return _build(_NESTED[option], value, where)
        kinds = _KINDS.get(option)
        if kinds and isinstance(value, kinds) and not (isinstance(value, bool) and option in ("int", "float")):
            return value
    raise ManifestError(f"manifest field {where} is {type(value).__name__} {value!r:.60}, expected {annotation}",
                        "the bundle is corrupt or was written by another tool; re-export it with specdec-export")


def _build(cls, data, where: str):
    """An instance of the dataclass `cls` from a JSON object, every field's type checked."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ManifestError(f"manifest section {where} is not an object", "re-export the bundle")
    data = {_LEGACY_KEYS.get(key, key): value for key, value in data.items()}
    values = {}
    for spec in fields(cls):
        if spec.name in data:
            values[spec.name] = _typed(data[spec.name], spec.type, f"{where}.{spec.name}")
        elif spec.default is MISSING and spec.default_factory is MISSING:
            _require(data, spec.name, where)
    return cls(**values)


def _model_from_dict(data: dict, role: str) -> ModelEntry:
    where = f"models.{role}"
    entry = _build(ModelEntry, data, where)
    return dataclasses.replace(
        entry,
        inputs=[_build(TensorSpec, s, f"{where}.inputs") for s in entry.inputs],
        outputs=[_build(TensorSpec, s, f"{where}.outputs") for s in entry.outputs],
        parity=[_build(ParityStep, s, f"{where}.parity") for s in entry.parity],
        engines=[_build(EngineRecord, r, f"{where}.engines") for r in entry.engines],
    )


def manifest_from_json(text: str) -> Manifest:
    """Parse manifest JSON and check its schema; raises ManifestError with a hint."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest.json is not valid JSON ({exc})", "re-export the bundle") from exc
    except (RecursionError, ValueError) as exc:  # nesting deeper than Python's stack; an integer too long to read
        raise ManifestError(f"manifest.json cannot be read ({type(exc).__name__}: nesting too deep or a value too "
                            "large)", "a specdec manifest is a few levels deep; re-export the bundle") from None
    version = _require(data, "schema_version", "manifest")
    if version != SCHEMA_VERSION:
        raise ManifestError(
            f"manifest schema_version is {version!r}; this specdec reads version {SCHEMA_VERSION}",
            "re-export the bundle with this version of specdec-export",
        )
    models = _typed(_require(data, "models", "manifest"), "dict", "manifest.models")
    if Role.TARGET not in models:
        raise ManifestError("manifest has no target model", "re-export the bundle")
    unknown = sorted(set(models) - set(ROLES))
    if unknown:
        raise ManifestError(f"manifest has unknown model roles {unknown}", f"roles are {list(ROLES)}")
    manifest = Manifest(
        schema_version=version,
        specdec_version=_typed(_require(data, "specdec_version", "manifest"), "str", "manifest.specdec_version"),
        tools=_typed(_require(data, "tools", "manifest"), "dict", "manifest.tools"),
        tokenizer=_build(TokenizerInfo, _require(data, "tokenizer", "manifest"), "tokenizer"),
        models={role: _model_from_dict(models[role], role) for role in models},
        defaults=_build(Defaults, _require(data, "defaults", "manifest"), "defaults"),
        head=_typed(data.get("head"), "HeadRecord | None", "head"),
    )
    validate_manifest(manifest)
    return manifest


def _inside(rel: str, where: str) -> None:
    """A path the manifest lists must stay inside the bundle: relative, with no '..'."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or "\\" in rel:
        raise ManifestError(f"manifest field {where} names {rel!r}, a path outside the bundle",
                            "a bundle lists only files inside its own directory; re-export it")


def _check_paths(manifest: Manifest) -> None:
    for rel in manifest.tokenizer.files:
        _inside(rel, "tokenizer.files")
    for role, entry in manifest.models.items():
        _inside(entry.onnx_path, f"models.{role}.onnx_path")
        for rel in entry.files:
            _inside(rel, f"models.{role}.files")
        for record in entry.engines:
            _inside(record.path, f"models.{role}.engines.path")
        if entry.native is not None:
            _inside(entry.native.path, f"models.{role}.native.path")
    if manifest.head is not None:
        for rel in [manifest.head.path, *manifest.head.files]:
            _inside(rel, "head.files")


def validate_manifest(manifest: Manifest) -> None:
    """Check values, paths and draft/target agreement."""
    _check_paths(manifest)
    for role, entry in manifest.models.items():
        if entry.precision not in PRECISIONS:
            raise ManifestError(f"{role} precision {entry.precision!r} is unknown", f"one of {PRECISIONS}")
        if entry.kv_dtype not in KV_DTYPES:
            raise ManifestError(f"{role} kv_dtype {entry.kv_dtype!r} is unknown", f"one of {KV_DTYPES}")
        if entry.lowering not in LOWERING_NAMES:
            raise ManifestError(f"{role} lowering {entry.lowering!r} is unknown", f"one of {LOWERING_NAMES}")
        if entry.max_seq_len <= 0 or entry.max_batch <= 0:
            raise ManifestError(
                f"{role} has max_seq_len={entry.max_seq_len}, max_batch={entry.max_batch}",
                "both must be positive; re-export the bundle",
            )
        sizes = [rel for rel, n in entry.sizes.items() if isinstance(n, bool) or not isinstance(n, int) or n < 0]
        if sizes:
            raise ManifestError(f"manifest field models.{role}.sizes gives {sizes[0]!r} {entry.sizes[sizes[0]]!r}, not "
                                "a byte count", "the manifest was edited; re-export the bundle")
        small = [name for name, value in asdict(entry.dims).items() if isinstance(value, int) and value < 1]
        if small:
            raise ManifestError(f"{role} dims.{small[0]} is {getattr(entry.dims, small[0])}", "dims are positive; "
                                "re-export the bundle")
    _check_defaults(manifest.defaults)
    check_vocab_agreement(manifest)


def sampling_problem(temperature, top_k, top_p) -> tuple[str, str] | None:
    """(message, hint) of the first sampling option out of range, or None: the rules of a request's options
    (runtime.config.GenerationConfig), kept here, in the stdlib layer, so that a manifest's defaults meet them."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:  # GenerationConfig's order
        return f"top_k must be an integer >= 0, got {top_k!r}", "use 0 to turn top-k off"
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature):
        return f"temperature must be a finite number, got {temperature!r}", "use 0 for greedy decoding"
    if temperature < 0:
        return f"temperature must be >= 0, got {temperature}", "use 0 for greedy decoding"
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        return f"top_p must be in (0, 1], got {top_p!r}", "use 1.0 to turn top-p off"
    return None


def _check_defaults(defaults: Defaults) -> None:
    if not 1 <= defaults.gamma <= defaults.gamma_max:
        raise ManifestError(
            f"default gamma {defaults.gamma} is outside 1..gamma_max={defaults.gamma_max}",
            "re-export or re-calibrate the bundle",
        )
    if defaults.max_prefill_chunk < 1:
        raise ManifestError(f"manifest defaults.max_prefill_chunk is {defaults.max_prefill_chunk}; it must be >= 1",
                            "set it to 256 in manifest.json, or re-export with --max-prefill-chunk 256")
    problem = sampling_problem(defaults.temperature, defaults.top_k, defaults.top_p)
    if problem is not None:
        raise ManifestError(f"manifest defaults: {problem[0]}", f"{problem[1]} (edit defaults in manifest.json, or "
                            "re-export the bundle)")
    if defaults.activations not in ACTIVATIONS:
        raise ManifestError(f"manifest defaults.activations is {defaults.activations!r}, not one of "
                            f"{', '.join(ACTIVATIONS)}", "set it to one of those in manifest.json, or re-export the "
                            "bundle")


def check_vocab_agreement(manifest: Manifest) -> None:
    """A draft must share the target's tokenizer; a padded vocabulary is allowed if the tokenizer fits."""
    tok_vocab = manifest.tokenizer.vocab_size
    for role, entry in manifest.models.items():
        if entry.dims.vocab_size < tok_vocab:
            raise ManifestError(
                f"{role} has vocab_size {entry.dims.vocab_size}, smaller than the tokenizer's {tok_vocab}",
                "draft and target must share one tokenizer; export them from the same family",
            )
    draft = manifest.draft
    if draft is not None and draft.max_seq_len < manifest.target.max_seq_len:
        raise ManifestError(
            f"draft max_seq_len {draft.max_seq_len} < target max_seq_len {manifest.target.max_seq_len}",
            "export both models with the same --max-seq-len",
        )


def read_manifest(bundle: str | os.PathLike) -> Manifest:
    path = Path(bundle)
    if path.exists() and not path.is_dir():
        raise ManifestError(f"{str(path)!r} is a file, not a bundle directory",
                            "pass the --out directory of specdec-export, not a file inside it")
    if not path.is_dir():
        raise ManifestError(
            f"bundle directory {str(path)!r} does not exist",
            "pass the --out directory of specdec-export (run `make demo` to build the default bundle)",
        )
    manifest_path = path / MANIFEST_NAME
    if not os.path.lexists(manifest_path):
        raise ManifestError(
            f"{str(manifest_path)!r} is missing: {str(path)!r} is not a specdec bundle",
            "pass the --out directory of specdec-export",
        )
    try:
        text = read_regular(manifest_path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise ManifestError(f"cannot read {str(manifest_path)!r}: {why}", "re-export the bundle") from None
    manifest = manifest_from_json(text)
    check_links(path, manifest)
    return manifest


def check_links(bundle: str | os.PathLike, manifest: Manifest) -> None:
    """Every file the manifest names must lie inside the bundle once symbolic links are followed: a link out of
    it would load weights or a tokenizer from elsewhere, unseen by a run with --no-verify. Cheap (no reading)."""
    root = Path(bundle).resolve()
    named = [*listed_files(manifest)] + [e.onnx_path for e in manifest.models.values()]
    named += [record.path for e in manifest.models.values() for record in e.engines]
    for rel in named:
        path = Path(bundle) / rel
        if path.is_symlink() or path.exists():
            resolved = path.resolve()
            if root not in resolved.parents:
                raise ManifestError(f"bundle file {rel!r} is a link to {str(resolved)!r}, outside the bundle",
                                    "a bundle holds its own files: copy the file into the bundle (or re-export)")


def listed_files(manifest: Manifest) -> dict:
    """Every file the manifest lists (relative path -> sha256): the tokenizer's and each model's."""
    expected = dict(manifest.tokenizer.files)
    for entry in manifest.models.values():
        expected.update(entry.files)
    if manifest.head is not None:
        expected.update(manifest.head.files)
    return expected


def check_bundle_files(bundle: str | os.PathLike, manifest: Manifest, only: list | None = None) -> None:
    """Verify that every file the manifest lists (or every file of `only`: the files a reader is about to read) exists,
    is a regular file, holds the recorded number of bytes (where the manifest records it: checked before the file is
    read) and has the recorded sha256. A file of `only` that the manifest does not list is an error: dropping a file's
    entry must not turn its check off."""
    root = Path(bundle)
    expected, sizes = listed_files(manifest), {rel: n for e in manifest.models.values() for rel, n in e.sizes.items()}
    if only is not None:
        unlisted = sorted(set(only) - set(expected))
        if unlisted:
            raise ManifestError(f"bundle file {unlisted[0]!r} is read but not listed in the manifest, so its sha256 "
                                "cannot be checked", "re-export the bundle (or load it with verify=False to skip the "
                                "hash checks knowingly)")
        expected = {rel: digest for rel, digest in expected.items() if rel in set(only)}
    for rel, digest in expected.items():
        path = root / rel
        if not os.path.lexists(path):
            raise ManifestError(f"bundle file {rel!r} is missing from {str(root)!r}", "re-export the bundle")
        try:
            handle = os.fdopen(open_regular(path), "rb")  # refuses a FIFO, a device, a socket or a directory
        except FileNotFoundError:  # a dangling link
            raise ManifestError(f"bundle file {rel!r} is missing from {str(root)!r}", "re-export the bundle") from None
        with handle:
            held = os.fstat(handle.fileno()).st_size
            if rel in sizes and held != sizes[rel]:
                raise ManifestError(f"bundle file {rel!r} has {held} bytes, the manifest records {sizes[rel]}: its "
                                    "sha256 cannot match (refused without reading it)", "the file was modified, "
                                    "padded or truncated; re-export the bundle (or copy it again)")
            actual = _sha256(handle)
        if actual != digest:
            raise ManifestError(
                f"bundle file {rel!r} has sha256 {actual[:12]}…, the manifest records {digest[:12]}…",
                "the file was modified or truncated; re-export the bundle",
            )
