"""The cuda backend on damaged native weights, on the numpy reference kernels (the CPU stand-in for kernels.cu): it
reads native.bin through the native engine's reader, so the checks at open refuse the same faults (a flipped exponent
bit in one block scale, a norm gain of 3e38 or a finite but absurd final norm, swapped offsets, a misread kind, a
padded file before it is hashed); and what passes them and overflows at run time ends in a NumericError naming the
model and the position: argmax reports a row whose logits hold NaN or no finite largest one, for a step, a verify
pass, a sampled request and a chain of greedy draft steps alike."""
from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

from specdec.errors import BackendError, NumericError
from specdec.runtime import GenerationConfig
from specdec.runtime.backend import unwrapped
from tests.cuda.conftest import reference
from tests.native.faults import edit_manifest, flip_scale, overflowing, poke, swap_offsets


@pytest.fixture
def bundle(q41_pair, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(q41_pair, copy)
    return copy


def _refused(bundle, message: str) -> None:
    with pytest.raises(BackendError, match=message) as caught:
        reference(bundle)
    assert "re-export" in caught.value.hint


@pytest.mark.parametrize("tensor,block,field", [("layers.0.qkv", 7, "d"), ("layers.1.down", 0, "m"), ("head", 77, "d")])
def test_a_flipped_exponent_bit_in_one_block_scale_is_refused(bundle, tensor, block, field):
    flipped = flip_scale(bundle, tensor, block, field)
    seen = "NaN or inf" if not np.isfinite(flipped) else f"{abs(flipped):.4g}"
    _refused(bundle, re.escape(f"tensor {tensor} holds {seen} (its blocks' {field})"))


@pytest.mark.parametrize("tensor,value", [("layers.1.input_norm", 3e38), ("final_norm", 1e6), ("final_norm", -2e4)])
def test_a_norm_gain_far_past_any_models_is_refused(bundle, tensor, value):
    poke(bundle, tensor, value, 8)
    _refused(bundle, re.escape(f"tensor {tensor} holds {abs(np.float32(value)):.4g}, beyond ±10000"))


def test_swapped_offsets_and_a_misread_kind_are_refused(bundle):
    swap_offsets(bundle, "layers.0.qkv", "layers.1.qkv")
    _refused(bundle, "the manifest reads tensor layers.0.qkv as .*; the file's own table holds it as")
    swap_offsets(bundle, "layers.0.qkv", "layers.1.qkv")
    reference(bundle).close()  # as exported again
    edit_manifest(bundle, lambda m: m["models"]["target"]["native"]["tensors"]["head"].update(kind="blk4"))
    _refused(bundle, "the manifest reads tensor head as blk4 .*; the file's own table holds it as blk8")


def test_a_padded_weights_file_is_refused_before_it_is_hashed(bundle):
    path = bundle / "target" / "native.bin"
    size = path.stat().st_size
    os.truncate(path, 4 << 30)  # sparse: 4 GiB of zeros after the weights
    _refused(bundle, f"has {4 << 30} bytes; its header says it ends at byte {size}")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_target_whose_logits_overflow_ends_in_an_error(bundle, temperature):
    overflowing(bundle)
    with reference(bundle) as gen:
        config = GenerationConfig(max_new_tokens=6, temperature=temperature, drafter="model", seed=1)
        with pytest.raises(NumericError, match=r"the target's logits at position \d+ of row 0 hold NaN or inf"):
            gen.generate("The quick brown fox", config)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_whose_logits_overflow_ends_in_an_error_not_a_proposal(bundle, temperature):
    """Greedy drafts run as one chain of steps on the device (argmax feeding the next step): a step whose logits were
    not sound is marked and refused on the host; a sampled draft's logits are checked as any forward's."""
    overflowing(bundle, "draft")
    with reference(bundle) as gen:
        config = GenerationConfig(max_new_tokens=6, temperature=temperature, drafter="model", seed=1)
        with pytest.raises(NumericError, match=r"the draft's logits at position \d+ of row 0 hold NaN or inf"):
            gen.generate("The quick brown fox", config)


def test_a_kv_that_turned_nan_is_named_with_its_position(q41_pair):
    with reference(q41_pair) as gen:
        target, draft = unwrapped(gen.target), unwrapped(gen.draft)
        target.reset(2)
        draft.reset(2)
        target.forward(np.array([[5, 6, 7, 8], [9, 10, 11, 12]]), np.array([0, 0]))
        target.model.keys[0, 1, :, 2] = np.nan  # layer 0, slot 1, position 2
        with pytest.raises(NumericError, match=r"the target's logits at position 4 of row 1 hold NaN or inf \(2 of "):
            target.forward(np.array([[13, 14], [15, 16]]), np.array([4, 4]))
        with pytest.raises(NumericError, match="the draft's logits at position 4 of row 1 hold NaN or inf"):
            draft.propose_greedy(np.array([13, 15]), np.array([4, 4]), np.array([0, 1]), 3)
        assert np.asarray(target.forward(np.array([[13]]), np.array([4]), slots=np.array([0]))).max() < np.inf
