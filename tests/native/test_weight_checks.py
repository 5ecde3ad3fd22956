"""Native weights are checked at open, not only their hash: every tensor aligned, inside its file and apart from the
others, and described by the manifest as the file's own table describes it (swapped offsets, a misread kind); the
file as long as its header says (padding or a cut refused before it is hashed or read); no NaN or inf where the
kernels read a float (rows, norms, block scales and minima), no block scale or minimum, bias or table value beyond
±65504 and no norm gain beyond ±1e4; and every file a backend or the tokenizer reads must be listed in the manifest
(dropping an entry does not turn its hash check off). A file that fails makes `auto` fall back to onnxruntime with the
reason, and `backend="native"` raise it. What passes every check and still overflows at run time ends in a
NumericError naming the model and the position, never in a token."""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.blocks import BF16, BLOCK4
from specdec.weights_file import nonfinite
from specdec.errors import BackendError, ManifestError, NumericError
from specdec.manifest import sha256_file
from specdec.native import build
from specdec.runtime import load
from tests.native.faults import edit_manifest, flip_scale, overflowing, poke, swap_offsets

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.fixture
def bundle(grid_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(grid_bundle, copy)
    return copy


def _refused_and_auto_falls_back(bundle, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        load(bundle, backend="native")
    with load(bundle) as gen:
        assert gen.backend == "onnxruntime" and re.search(message, gen.backend_note)


@pytest.mark.parametrize("tensor,value", [("layers.0.qkv", np.nan), ("layers.1.input_norm", np.inf),
                                          ("final_norm", -np.inf), ("layers.0.down", np.nan)])
def test_weights_holding_nan_or_inf_are_refused(bundle, tensor, value):
    poke(bundle, tensor, value)
    _refused_and_auto_falls_back(bundle, f"tensor {tensor} holds NaN or inf")


def _tensor(bundle, name: str):
    return lambda m: m["models"]["target"]["native"]["tensors"][name]


@pytest.mark.parametrize("case,edit,message", [
    ("misaligned", lambda t: t["layers.0.qkv"].update(offset=t["layers.0.qkv"]["offset"] + 8), "not a multiple of 64"),
    ("overlapping", lambda t: t["layers.0.o"].update(offset=t["layers.0.qkv"]["offset"]), "overlap"),
    ("past the end", lambda t: t["final_norm"].update(offset=t["final_norm"]["offset"] + (1 << 30)), "bytes; tensor"),
    ("in the header", lambda t: t["final_norm"].update(offset=0), "past the header"),
])
def test_tensors_out_of_place_are_refused(bundle, case, edit, message):
    edit_manifest(bundle, lambda m: edit(m["models"]["target"]["native"]["tensors"]))
    _refused_and_auto_falls_back(bundle, message)


def test_a_file_read_must_be_listed(bundle):
    edit_manifest(bundle, lambda m: m["models"]["target"]["files"].pop("target/native.bin"))
    with pytest.raises(ManifestError, match="target/native.bin' is read but not listed"):
        load(bundle, backend="native")
    with load(bundle) as gen:  # onnxruntime reads the graph, which is listed
        assert gen.backend == "onnxruntime" and "not listed" in gen.backend_note
    edit_manifest(bundle, lambda m: m["tokenizer"]["files"].pop("tokenizer.json"))
    with pytest.raises(ManifestError, match="tokenizer.json' is read but not listed") as caught:
        load(bundle)
    assert "verify=False" in caught.value.hint
    load(bundle, verify=False).close()  # knowingly unchecked


def test_nonfinite_reads_every_float_kind():
    rows = np.zeros((3, 64), np.float32)
    assert not nonfinite(rows) and not nonfinite((rows.view(np.uint32) >> 16).astype(BF16))
    for value in (np.nan, np.inf, -np.inf):
        bad = rows.copy()
        bad[2, 63] = value
        assert nonfinite(bad) and nonfinite((bad.view(np.uint32) >> 16).astype(BF16))
        assert nonfinite(bad.astype(np.float16))
        blocks = np.zeros((2, 2), BLOCK4)
        blocks["m"][1, 1] = value
        assert nonfinite(blocks)
    assert not nonfinite(np.full(5, 2**62, np.int64))  # integers hold no NaN


@pytest.mark.parametrize("tensor,block,field", [("layers.0.qkv", 7, "d"), ("layers.1.down", 0, "m"), ("head", 77, "d"),
                                                ("layers.1.gate_up", 3, "d"), ("layers.0.o", 1, "m"), ("head", 0, "d")])
def test_a_flipped_exponent_bit_in_one_block_scale_is_refused(bundle, tensor, block, field):
    """The top exponent bit of one block's scale or minimum flipped (every logit turned NaN): a value below 2 in size
    grows by 2**128, one of 1 to 2 turns inf or NaN; either lies far past any scale a GGUF holds."""
    flipped = flip_scale(bundle, tensor, block, field)
    seen = "NaN or inf" if not np.isfinite(flipped) else f"{abs(flipped):.4g}"
    _refused_and_auto_falls_back(bundle, re.escape(f"tensor {tensor} holds {seen} (its blocks' {field})"))


@pytest.mark.parametrize("tensor,value,at,bound", [("layers.1.input_norm", 3e38, 0, "10000"),
                                                   ("final_norm", 1e6, 12, "10000"), ("final_norm", -2e4, 60, "10000"),
                                                   ("layers.0.post_norm", 1e30, 4, "10000"), ("sin", 2e5, 40, "65504")])
def test_a_norm_gain_or_table_value_far_past_any_models_is_refused(bundle, tensor, value, at, bound):
    """A norm gain of 3e38 turned the logits to NaN; a finite but absurd final_norm made the real bundle print one
    token over and over. Norm gains are bounded by ±1e4 (the default model's largest gain is 3.4), biases, positions
    and rotary tables by ±65504."""
    poke(bundle, tensor, value, at)
    _refused_and_auto_falls_back(bundle, re.escape(f"tensor {tensor} holds {abs(np.float32(value)):.4g}, beyond "
                                                   f"±{bound}"))


@pytest.mark.parametrize("first,second", [("layers.0.qkv", "layers.1.qkv"), ("layers.0.input_norm", "final_norm"),
                                          ("layers.1.post_norm", "layers.0.input_norm"), ("cos", "sin")])
def test_swapped_offsets_are_refused(bundle, first, second):
    """Two tensors of one kind and shape swapped in the manifest pass every bound and overlap nothing: the file's own
    table of its tensors says where each lies."""
    swap_offsets(bundle, first, second)
    _refused_and_auto_falls_back(bundle, f"the manifest reads tensor ({first}|{second}) as .* at byte .*; the file's "
                                         "own table holds it as")


def test_a_misread_kind_is_refused(bundle):
    """A manifest reading the head's blk8 blocks as blk4 (smaller: they fit in its bytes) is refused by the table."""
    edit_manifest(bundle, lambda m: m["models"]["target"]["native"]["tensors"]["head"].update(kind="blk4"))
    _refused_and_auto_falls_back(bundle, "the manifest reads tensor head as blk4 .*; the file's own table holds it "
                                         "as blk8")


def _read_bytes() -> int:
    """Bytes this process has read through read(2) and its kin (Linux's /proc/self/io rchar)."""
    for line in open("/proc/self/io", encoding="ascii"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/self/io")
@pytest.mark.parametrize("verify", [True, False])
def test_a_padded_weights_file_is_refused_before_it_is_read(bundle, verify):
    """4 GiB of zeros after 100 KiB of weights (a sparse file): refused from its header and size, before a hash reads
    it or a copy takes its memory; with verify=False too. So is a file cut short, its hash recorded after the cut."""
    path = bundle / "target" / "native.bin"
    size = path.stat().st_size
    os.truncate(path, 4 << 30)
    before = _read_bytes()
    with pytest.raises(BackendError, match=f"has {4 << 30} bytes; its header says it ends at byte {size}") as caught:
        load(bundle, backend="native", verify=verify)
    assert "padded or cut short" in caught.value.message and "re-export" in caught.value.hint
    assert _read_bytes() - before < 64 << 20  # the tokenizer, the manifest, the header: never the 4 GiB
    with load(bundle, verify=verify) as gen:
        assert gen.backend == "onnxruntime" and "padded or cut short" in gen.backend_note
    os.truncate(path, size - 100)
    edit_manifest(bundle, lambda m: m["models"]["target"]["files"].update({"target/native.bin": sha256_file(path)}))
    with pytest.raises(BackendError, match=f"has {size - 100} bytes; its header says it ends at byte {size}"):
        load(bundle, backend="native", verify=verify)


@pytest.mark.parametrize("drafter,temperature", [("none", 0.0), ("auto", 0.0), ("model", 0.0), ("model", 0.8),
                                                 ("auto", 0.8)])
def test_logits_that_overflow_end_in_an_error_not_a_token(bundle, drafter, temperature):
    """Weights within every bound whose products overflow: each forward's logits are checked, so generation ends in
    a NumericError naming the model and the position (greedy or sampled, plain, drafted or auto), where it emitted
    token 0 (argmax of all-NaN) or one fixed sampled token."""
    overflowing(bundle)
    with load(bundle, backend="native") as gen:
        config = GenerationConfig(max_new_tokens=6, temperature=temperature, drafter=drafter, seed=1)
        with pytest.raises(NumericError, match=r"the target's logits at position \d+ of row 0 hold NaN or inf") as \
                caught:
            gen.generate("The quick brown fox", config)
    assert "re-export" in caught.value.hint and isinstance(caught.value, BackendError)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_whose_logits_overflow_ends_in_an_error_not_a_proposal(q41_bundle, tmp_path, temperature):
    """The native draft's own blocks (fp16 scales, within their format) overflowing: the model drafter raises the
    draft's NumericError rather than propose argmax's token 0 or a sample of NaN."""
    shutil.copytree(q41_bundle, tmp_path / "b")
    overflowing(tmp_path / "b", "draft")
    with load(tmp_path / "b", backend="native") as gen:
        config = GenerationConfig(max_new_tokens=6, temperature=temperature, drafter="model", seed=1)
        with pytest.raises(NumericError, match=r"the draft's logits at position \d+ of row 0 hold NaN or inf"):
            gen.generate("The quick brown fox", config)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_kv_that_turned_nan_is_named_with_its_position(q41_bundle, role):
    """NaN in the KV of one position (the draft reads its target's): the next forward of that row says which model
    and which position, and the logits of the other rows were fine."""
    with load(q41_bundle, backend="native") as gen:
        target, draft = gen.target.backend, gen.draft.backend
        target.reset(2)
        draft.reset(2)
        target.forward(np.array([[5, 6, 7, 8], [9, 10, 11, 12]]), np.array([0, 0]))
        target.model.keys[0, 1, :, 2] = np.nan  # layer 0, slot 1, position 2
        model = target if role == "target" else draft
        with pytest.raises(NumericError, match=f"the {role}'s logits at position 4 of row 1 hold NaN or inf "
                           r"\(2 of the call's 4 positions\)"):
            model.forward(np.array([[13, 14], [15, 16]]), np.array([4, 4]))
        assert np.isfinite(model.forward(np.array([[13]]), np.array([4]), slots=np.array([0]))).all()
