"""A draft derived from the target takes the target's committed KV instead of computing its own (prefill and
catch-ups become copies). Exactness never depends on it; these tests check the copy itself and where it applies."""
from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec.runtime.config import GenerationConfig


def _layers(backend) -> list:
    """(keys, values) per layer, each [batch, Hkv, S, D], whichever driver holds them."""
    driver = backend.driver
    if hasattr(driver, "buffers"):  # gqa: keys of every layer, then values
        half = len(driver.buffers) // 2
        return list(zip(driver.buffers[:half], driver.buffers[half:]))
    return [(driver.keys[i], driver.values[i]) for i in range(driver.keys.shape[0])]


@pytest.fixture(scope="module", params=["plain", "gqa"])
def layers_gen(request, tmp_path_factory, tiny_llama, export_tiny):
    """A draft of the target's first layer (fp32): its own KV is the target's first layer's, to float rounding."""
    out = tmp_path_factory.mktemp("b") / f"layers-{request.param}"
    with specdec.load(export_tiny(out, tiny_llama, draft_layers=1, lowering=request.param)) as gen:
        yield gen


def test_only_a_draft_derived_from_the_target_takes_its_kv(int4_gen, random_gen, layers_gen):
    assert int4_gen.draft.takes_kv_from(int4_gen.target) and layers_gen.draft.takes_kv_from(layers_gen.target)
    assert not random_gen.draft.takes_kv_from(random_gen.target)  # other weights: its own KV, always
    assert not int4_gen.target.takes_kv_from(int4_gen.draft)  # never the other way


def test_a_copied_cache_gives_the_logits_the_draft_computes_itself(layers_gen):
    target, draft = layers_gen.target, layers_gen.draft
    target.reset(2)
    draft.reset(2)
    ids = np.arange(5, 25, dtype=np.int64)[None]  # [1, 20]
    own = draft.forward(ids, np.zeros(1, np.int64), slots=np.array([0]))[0, -1]  # slot 0: the draft's own prefill
    target.forward(ids[:, :-1], np.zeros(1, np.int64), slots=np.array([1]))  # slot 1: the target's KV, copied
    draft.copy_kv(target, 1, 0, 19)
    copied = draft.forward(ids[:, -1:], np.array([19]), slots=np.array([1]))[0, -1]
    np.testing.assert_allclose(copied, own, atol=1e-4)
    for (keys, values), (t_keys, t_values) in zip(_layers(draft), _layers(target)):  # the first layer, exactly
        assert np.array_equal(keys[1, :, :19], t_keys[1, :, :19]) and np.array_equal(values[1, :, :19], t_values[1, :, :19])
        assert not np.array_equal(values[1, :, :19], t_keys[1, :, :19])  # keys and values not crossed


def test_copy_writes_only_the_asked_positions_of_the_asked_slot(int4_gen):
    target, draft = int4_gen.target, int4_gen.draft
    target.reset(2)
    draft.reset(2)
    for t_layer in _layers(target):
        for buffer in t_layer:
            buffer[...] = np.random.default_rng(0).standard_normal(buffer.shape)
    before = [(k.copy(), v.copy()) for k, v in _layers(draft)]
    draft.copy_kv(target, 1, 3, 8)
    for (keys, values), (old_k, old_v), (t_keys, t_values) in zip(_layers(draft), before, _layers(target)):
        assert np.array_equal(keys[1, :, 3:8], t_keys[1, :, 3:8]) and np.array_equal(values[1, :, 3:8], t_values[1, :, 3:8])
        changed = np.ones(keys.shape, bool)
        changed[1, :, 3:8] = False
        assert np.array_equal(keys[changed], old_k[changed]) and np.array_equal(values[changed], old_v[changed])


def test_the_draft_no_longer_prefills_the_prompt_and_output_stays_exact(int4_gen, monkeypatch):
    prompt = list(range(10, 60))  # 50 tokens
    config = GenerationConfig(max_new_tokens=12, drafter="model", gamma=3)
    reference = int4_gen.generate(prompt, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids
    fed = []
    inner = int4_gen.draft.backend
    original = inner.run

    def counting(request):
        fed.append(int(request.input_ids.shape[1]))
        return original(request)

    monkeypatch.setattr(inner, "run", counting)
    result = int4_gen.generate(prompt, config)
    assert result.token_ids == reference and len(reference) == 12
    assert fed and max(fed) <= 2 and sum(fed) < len(prompt)  # one-token steps (two after all drafts were accepted)
