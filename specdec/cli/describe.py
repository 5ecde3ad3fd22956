"""describe_bundle: the text of `specdec inspect` (stdlib only)."""
from __future__ import annotations

from pathlib import Path

from specdec.manifest import ModelEntry, check_bundle_files, read_manifest


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _model_lines(entry: ModelEntry) -> list[str]:
    d = entry.dims
    lines = [
        f"{entry.role}: {d.model_type}, {d.num_layers} layers, {d.num_heads} heads / {d.num_kv_heads} kv heads, "
        f"head dim {d.head_dim}, hidden {d.hidden_size}, vocab {d.vocab_size}",
        f"  source     {entry.source.name}" + (f"  (derived: {entry.derived})" if entry.derived else ""),
        f"  precision  {entry.precision}, kv {entry.kv_dtype}, logits {entry.logits_dtype}, lowering {entry.lowering}",
        f"  S={entry.max_seq_len}  max_batch={entry.max_batch}  size {_mib(entry.size_bytes)}",
    ]
    if entry.native is not None:  # what the native engine reads: GGUF blocks, or rows in the weights' own precision
        lines.append(f"  native     {entry.native.layout} weights ({entry.native.path})")
    if entry.parity:
        lines.append("  parity (max |ONNX - PyTorch| logits):")
        for step in entry.parity:
            verdict = "ok" if step.max_abs_diff <= step.tolerance else "over"
            if not step.enforced:
                verdict = "informational (quantized)"
            lines.append(
                f"    {step.name:<17} T={step.tokens:<3} cache_len={step.cache_len:<4} "
                f"{step.max_abs_diff:.3e}  (tol {step.tolerance:.3e}, {verdict})"
            )
    else:
        lines.append(f"  parity     {entry.parity_note or 'not checked'}")
    lines += [f"  sha256     {digest[:16]}…  {rel}" for rel, digest in entry.files.items()]
    lines += [f"  engine     {e.path} (compute capability {e.compute_capability}, TensorRT {e.tensorrt_version})"
              for e in entry.engines]
    return lines


def describe_bundle(bundle: str | Path, verify: bool = True) -> str:
    manifest = read_manifest(bundle)
    if verify:
        check_bundle_files(bundle, manifest)
    tok, defaults = manifest.tokenizer, manifest.defaults
    lines = [
        f"bundle {bundle}  (schema {manifest.schema_version}, specdec {manifest.specdec_version})",
        "tools: " + ", ".join(f"{k} {v}" for k, v in manifest.tools.items()),
        f"tokenizer: vocab {tok.vocab_size}, eos {tok.eos_token_ids}, chat template {'yes' if tok.has_chat_template else 'no'}",
        f"defaults: gamma {defaults.gamma}, gamma_max {defaults.gamma_max}, prefill chunk {defaults.max_prefill_chunk}, "
        f"native activations {defaults.activations}",
        "hashes: " + ("verified" if verify else "not checked"),
    ]
    for entry in manifest.models.values():
        lines += _model_lines(entry)
    if manifest.draft is None:
        lines.append("draft: none (prompt lookup or plain decoding)")
    return "\n".join(lines)
