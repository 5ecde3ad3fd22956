"""No logits without a distribution reach a token (issue 50): the host backends' check of every position's logits
(a NaN, or no finite largest logit), onnxruntime's end to end on a graph whose weights hold NaN, and sampling's own
refusal. The native and cuda backends' checks: tests/native/test_weight_checks.py, tests/cuda/test_cuda_faults.py."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import specdec
from specdec.errors import BackendError, NumericError
from specdec.manifest import sha256_file
from specdec.runtime.backend import check_logits
from specdec.runtime.config import GenerationConfig
from specdec.runtime.sampling import warp


def test_host_logits_are_checked_at_every_position():
    logits = np.zeros((2, 3, 40), np.float32)
    logits[0, :, 5] = -np.inf  # a token of probability 0: sound
    assert check_logits(logits, "target", np.array([4, 9]), 3, False) is logits
    for bad in (np.nan, np.inf):
        broken = logits.copy()
        broken[1, 2, 7] = bad
        with pytest.raises(NumericError, match="the target's logits at position 11 of row 1 hold NaN or inf") as caught:
            check_logits(broken, "target", np.array([4, 9]), 3, False)
        assert "re-export" in caught.value.hint and isinstance(caught.value, BackendError)
    broken = logits.copy()
    broken[:, -1] = -np.inf  # two positions whose every logit is -inf: no distribution
    with pytest.raises(NumericError, match=r"the draft's logits at position 6 of row 0 hold NaN or inf \(2 of the "
                                           r"call's 6 positions\)"):
        check_logits(broken, "draft", np.array([4, 9]), 3, False)
    with pytest.raises(NumericError, match="the draft's logits at position 11 of row 0"):  # last_only: the last
        check_logits(broken[:, -1:], "draft", np.array([9, 9]), 3, True)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_sampling_refuses_logits_without_a_distribution(value):
    logits = np.zeros((2, 10), np.float32)
    logits[1, 3] = value
    with pytest.raises(NumericError, match=f"logits to sample from hold {float(value)}") as caught:
        warp(logits, GenerationConfig(temperature=0.8))
    assert "report it" in caught.value.hint
    logits[1, 3] = -np.inf  # probability 0, as top-k makes it
    assert warp(logits, GenerationConfig(temperature=0.8))[1, 3] == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_onnxruntime_on_weights_holding_nan_ends_in_an_error_not_a_token(int4_bundle, tmp_path, temperature):
    """NaN in the target graph's data (its hash recorded after): onnxruntime's logits are NaN, and generation ends
    in the target's NumericError where it emitted token 0 (greedy) or a fixed sampled token."""
    bundle = tmp_path / "b"
    shutil.copytree(int4_bundle, bundle)
    data = bundle / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[: 1 << 16] = np.full(1 << 14, np.nan, np.float32).tobytes()  # the first weights, whatever they are
    data.write_bytes(bytes(raw))
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["models"]["target"]["files"]["target/model.onnx.data"] = sha256_file(data)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with specdec.load(bundle, backend="onnxruntime") as gen:
        config = GenerationConfig(max_new_tokens=4, temperature=temperature, drafter="none", seed=1)
        with pytest.raises(NumericError, match=r"the target's logits at position \d+ of row 0 hold NaN or inf"):
            gen.generate("The quick brown fox", config)
