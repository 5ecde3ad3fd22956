"""fp16 exports pass parity on onnxruntime's CPU EP; bf16 ones record why parity was not run."""
from __future__ import annotations

import pytest

import specdec
from specdec.errors import BackendError
from specdec.manifest import read_manifest


def test_fp16_export_parity_and_generation(tmp_path, tiny_llama, export_tiny):
    bundle = export_tiny(tmp_path / "fp16", tiny_llama, no_draft=True, dtype="fp16")
    entry = read_manifest(bundle).target
    assert (entry.precision, entry.kv_dtype, entry.parity_note) == ("fp16", "float16", "checked")
    assert entry.parity and all(s.max_abs_diff <= s.tolerance for s in entry.parity)
    with specdec.load(bundle) as gen:
        assert gen.generate("The quick", specdec.GenerationConfig(max_new_tokens=4)).token_ids


def test_bf16_export_records_skipped_parity_and_the_cpu_runtime_refuses_it(tmp_path, tiny_llama, export_tiny):
    bundle = export_tiny(tmp_path / "bf16", tiny_llama, no_draft=True, dtype="bf16")
    entry = read_manifest(bundle).target
    assert entry.parity == [] and "no bf16 kernels" in entry.parity_note
    with pytest.raises(BackendError, match="bfloat16") as info:
        specdec.load(bundle)
    assert "fp32" in info.value.hint
