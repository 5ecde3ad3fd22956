"""export_bundle: HF target (+ draft) -> a bundle directory, written atomically (temp dir, then rename)."""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from specdec.errors import ExportError
from specdec.export.architectures import architecture_for, dims_from_config, supported_model_types
from specdec.export.config import DraftOrigin, ExportConfig
from specdec.export.drafts import int4_from_onnx, layer_draft, layer_draft_range
from specdec.export.onnx_graph import KV_DTYPE_NAMES, TORCH_DTYPES, onnx_from_hf
from specdec.export.native_pack import NativeSkipped, write_target
from specdec.export.parity import check_parity, enforce_parity, runner_for
from specdec.export.sources import (
    ModelSource,
    check_template,
    load_config,
    load_model,
    load_tokenizer,
    resolve_source,
    rounded,
)
from specdec.native_record import Activations
from specdec.weight_kinds import DTYPES, WEIGHT_LAYOUTS, WeightKind
from specdec.chat_template import read_chat_template
from specdec.lowering import lowering_for
from specdec.manifest import (
    MANIFEST_NAME,
    LoweringName,
    SCHEMA_VERSION,
    Defaults,
    Manifest,
    ModelEntry,
    Precision,
    Role,
    TokenizerInfo,
    json_from_manifest,
    sha256_file,
)
from specdec.publish import check_destination, staged_bundle
from specdec.version import __version__

log = logging.getLogger(__name__)


class _Steps:
    """A progress bar over the named long steps of an export."""

    def __init__(self, names: list[str], enabled: bool):
        self.names = names
        self.enabled = enabled
        self.bar = None

    def __enter__(self):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=len(self.names), disable=not self.enabled, unit="step", desc="export")
        return self

    def __exit__(self, *exc):
        self.bar.close()

    @contextlib.contextmanager
    def step(self, name: str):
        self.bar.set_description(name)
        started = time.perf_counter()
        yield
        log.info("%s: %.1f s", name, time.perf_counter() - started)
        self.bar.update(1)


def _check_target(source: ModelSource, config: ExportConfig):
    hf_config = load_config(source)
    if hf_config.model_type not in supported_model_types():
        raise ExportError(
            f"model type {hf_config.model_type!r} of {source.name!r} is not supported",
            f"supported model types: {', '.join(supported_model_types())}",
        )
    return hf_config


def _check_length(hf_config, config: ExportConfig, role: str) -> None:
    positions = dims_from_config(hf_config).max_positions
    if config.max_seq_len > positions:
        raise ExportError(
            f"--max-seq-len {config.max_seq_len} exceeds the {role}'s {positions} positions",
            f"pass --max-seq-len {positions} or less",
        )


def _preflight(config: ExportConfig):
    """Every check that needs no weights, before the slow loads: sources, architectures, lengths, tokenizers."""
    source = resolve_source(config.target)
    hf_config = _check_target(source, config)
    _check_length(hf_config, config, "target")
    if config.draft_layers is not None:
        layer_draft_range(dims_from_config(hf_config).num_layers, config.draft_layers)
    draft_source = None
    if config.draft_origin == DraftOrigin.MODEL:
        draft_source = resolve_source(config.draft)
        _check_length(_check_target(draft_source, config), config, "draft")
    tokenizer = load_tokenizer(source)
    check_template(getattr(tokenizer, "chat_template", None), tokenizer.special_tokens_map, source.name)
    if draft_source is not None:
        _check_tokenizers_agree(tokenizer, load_tokenizer(draft_source), draft_source.name)
    return source, draft_source, tokenizer


def _files_of(root: Path, folder: str) -> dict:
    return {f"{folder}/{p.name}": sha256_file(p) for p in sorted((root / folder).iterdir()) if p.is_file()}


def _session(path: Path, dtype: str):
    """(onnxruntime CPU session, "") or (None, why) where the CPU EP has no kernels for the dtype."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), ""
    except Exception as exc:  # onnxruntime raises its own C++ exception types
        if dtype == Precision.BF16 and "NOT_IMPLEMENTED" in str(exc):
            log.warning("parity not checked: onnxruntime's CPU EP has no bf16 kernels")
            return None, "skipped: onnxruntime's CPU EP has no bf16 kernels; check on a GPU back end"
        raise ExportError(f"onnxruntime cannot load the exported {path.name}: {exc}", "run with -v and report it") from exc


def _export_model(role, arch, reference, source, derived, root, config, steps, precision=None):
    """Export (or quantize to `precision` int4) one model into root/role/, check parity, and return its ModelEntry."""
    path = root / role / "model.onnx"
    quantized = precision == Precision.INT4
    features = config.target_features(arch.dims.num_layers) if role == Role.TARGET else ()
    with steps.step(f"export {role}"):
        if quantized:
            int4_from_onnx(root / "target" / "model.onnx", path)
        else:
            onnx_from_hf(arch, config.max_seq_len, config.max_batch, config.dtype, path, config.lowering, features)
    parity, note = [], "skipped (--skip-parity)"
    if config.check_parity:
        with steps.step(f"check {role}"):
            session, note = _session(path, config.dtype)
        if session is not None:
            enforced = not quantized
            runner = runner_for(session, arch.dims, config.max_seq_len, KV_DTYPE_NAMES[config.dtype], config.lowering)
            parity, _ = check_parity(runner, reference, arch.dims, config.max_seq_len, config.gamma_max,
                                     config.dtype, enforced)
            del session
            enforce_parity(role, parity)
            note = "checked" if enforced else "informational: quantized graph"
    inputs, outputs = lowering_for(config.lowering).io_specs(arch.dims, config.max_seq_len, KV_DTYPE_NAMES[config.dtype],
                                                             features)
    native, native_note = _native_weights(root, role, arch, config, source) if role == Role.TARGET else (None, "")
    files = _files_of(root, role)
    return ModelEntry(
        role=role,
        source=source.describe(),
        derived=derived,
        dims=arch.dims,
        max_seq_len=config.max_seq_len,
        max_batch=config.max_batch,
        precision=precision or config.dtype,
        kv_dtype=KV_DTYPE_NAMES[config.dtype],
        logits_dtype="float32",
        lowering=config.lowering,
        onnx_path=f"{role}/model.onnx",
        files=files,
        inputs=inputs,
        outputs=outputs,
        parity=list(parity),
        parity_note=note,
        size_bytes=sum((root / rel).stat().st_size for rel in files),
        native=native,
        native_note=native_note,
        feature_layers=list(features),
        sizes={rel: (root / rel).stat().st_size for rel in files},
    )


def _default_activations(target) -> Activations:
    """The bundle's default activations where --activations is unset: int8 where the target's native weights are
    blocks (a GGUF's grids: the int8 kernels take its Q4_1, Q8_0 and Q6_K blocks); bf16 where they are bf16 rows (a
    CPU without AMX-BF16 runs such a default as fp32: specdec.runtime.registry); else fp32 (f16 or fp32 rows, or no
    native weights). Why: docs/backends.md, "int8 activations" and "bf16 activations"."""
    native = target.native
    if native is None:
        return Activations.FP32
    layout = WEIGHT_LAYOUTS[native.layout]
    if layout.linear is WeightKind.BF16:
        return Activations.BF16
    return Activations.FP32 if layout.rows else Activations.INT8


def _native_weights(root: Path, role: str, arch, config: ExportConfig, source) -> tuple:
    """(NativeRecord, "" or which of a GGUF's block types became rows) of an fp32 gqa target's native weights, or
    (None, why it cannot have them)."""
    dims = arch.dims
    if config.dtype != Precision.FP32:
        return None, f"the {role} is exported in {config.dtype}; the native engine reads an fp32 export's weights"
    if config.lowering != LoweringName.GQA:  # the engine computes the gqa graph's function, its KV in that layout
        return None, f"{dims.model_type}, {config.lowering} lowering: the native engine runs gqa exports"
    try:
        record = write_target(root, role, arch, config.max_seq_len)
        gguf = source.path / source.gguf_file if source.gguf_file is not None else None
        return record, gguf_rows_note(gguf, record.layout) if gguf is not None else ""
    except NativeSkipped as why:
        log.info("no native weights for the %s: %s", role, why)
        return None, f"{dims.model_type}, {config.lowering} lowering: {why}"


def gguf_rows_note(gguf: Path, layout: str) -> str:
    """Where a GGUF's weights became rows (layout bf16 / f16 / f32): which of its quantized tensor types no native
    block holds, for the manifest's native_note and so `gen.backend_note`; "" where they kept blocks."""
    if not WEIGHT_LAYOUTS[layout].rows:
        return ""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    kept = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0}  # blocks or rows
    kinds = sorted(kind.name for kind in {tensor.tensor_type for tensor in GGUFReader(str(gguf)).tensors} - kept)
    if not kinds:
        return ""
    return (f"the GGUF's {', '.join(kinds)} tensors fit no block the native engine keeps (it keeps Q4_0, Q4_1, Q4_K, "
            f"Q5_0, Q5_1, Q5_K, Q6_K and Q8_0): it runs the weights as {layout} rows, the same function at "
            f"{8 * DTYPES[layout].itemsize} bits a weight")


def _tokenizer_info(tokenizer, model, root: Path) -> TokenizerInfo:
    tokenizer.save_pretrained(str(root))
    check_template(*read_chat_template(root), "the bundle being written")  # what the runtime will render
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} - {None})
    files = {p.name: sha256_file(p) for p in sorted(root.iterdir()) if p.is_file()}
    return TokenizerInfo(
        vocab_size=len(tokenizer),
        eos_token_ids=eos_ids,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        files=files,
    )


def _check_tokenizers_agree(target_tok, draft_tok, draft_name: str) -> None:
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
        raise ExportError(
            f"the draft {draft_name!r} has a different tokenizer than the target "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. {differing})",
            "the draft must share the target's tokenizer token for token; use --draft-from-target or --draft-layers",
        )
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        raise ExportError(
            f"draft EOS id {draft_tok.eos_token_id} differs from the target's {target_tok.eos_token_id}",
            "the draft must share the target's tokenizer and special tokens",
        )


def _tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    tools = {}
    for name in ("torch", "transformers", "onnx", "onnxruntime", "optimum"):
        try:
            tools[name] = version(name)
        except PackageNotFoundError:
            tools[name] = None
    return tools


def _step_names(config: ExportConfig) -> list[str]:
    names = ["load models", "export target"] + (["check target"] if config.check_parity else [])
    if config.draft_origin != DraftOrigin.NONE:
        names += ["export draft"] + (["check draft"] if config.check_parity else [])
    return names + ["write bundle"]


def _load_draft(config: ExportConfig, target_arch, draft_source, dtype):
    """(architecture, reference model, source, derived tag) of the draft, or None."""
    origin = config.draft_origin
    if origin == DraftOrigin.NONE:
        return None
    if origin == DraftOrigin.LAYERS:
        arch = layer_draft(target_arch, config.draft_layers)
        return arch, arch.model, None, f"layers:{config.draft_layers}"
    if origin == DraftOrigin.INT4:
        return target_arch, target_arch.model, None, DraftOrigin.INT4.value
    arch = architecture_for(rounded(load_model(draft_source, dtype), config.weights))
    return arch, arch.model, draft_source, ""


def sources_read(config: ExportConfig) -> list[Path]:
    """The local paths an export reads (the default model's package included): --out must not overlap them."""
    names = [config.target] + ([config.draft] if config.draft is not None else [])
    sources = [resolve_source(name) for name in names]
    return [source.path / source.gguf_file if source.gguf_file else source.path for source in sources]


def export_bundle(config: ExportConfig) -> Path:
    """Build the bundle of docs/export.md at config.out; nothing is left behind on error, nothing else is replaced."""
    check_destination(config.out, config.overwrite, sources_read(config))
    source, draft_source, tokenizer = _preflight(config)
    with staged_bundle(config.out) as tmp:
        with _Steps(_step_names(config), config.progress) as steps:
            dtype = TORCH_DTYPES[config.dtype]
            with steps.step("load models"):
                target = architecture_for(rounded(load_model(source, dtype), config.weights))
                draft = _load_draft(config, target, draft_source, dtype)
            models = {Role.TARGET: _export_model(Role.TARGET, target, target.model, source, "", tmp, config, steps)}
            if draft is not None:
                arch, reference, draft_source, derived = draft
                precision = Precision.INT4 if config.draft_origin == DraftOrigin.INT4 else None
                models[Role.DRAFT] = _export_model(
                    Role.DRAFT, arch, reference, draft_source or source, derived, tmp, config, steps, precision
                )
            with steps.step("write bundle"):
                manifest = Manifest(
                    schema_version=SCHEMA_VERSION,
                    specdec_version=__version__,
                    tools=_tool_versions(),
                    tokenizer=_tokenizer_info(tokenizer, target.model, tmp),
                    models=models,
                    defaults=Defaults(config.gamma, config.gamma_max, config.max_prefill_chunk,
                                      activations=config.activations or _default_activations(models[Role.TARGET])),
                )
                (tmp / MANIFEST_NAME).write_text(json_from_manifest(manifest), encoding="utf-8")
    return config.out
