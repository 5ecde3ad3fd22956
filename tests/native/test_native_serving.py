"""`specdec serve --backend native` (and `auto`, which opens native for this bundle): requests served concurrently on
the native backend (the int4-q41 draft on the target's blocks, each row's slot of the shared KV) give onnxruntime's
offline target-only greedy text."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import specdec
from specdec import GenerationConfig
from specdec.errors import ConfigError
from specdec.native import build
from specdec.serving.options import ServeOptions
from tests.serving.conftest import client, metric, start
from tests.serving.test_serve_exactness import NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.mark.parametrize("speculation,backend", [("fixed", "native"), ("adaptive", "native"), ("fixed", "auto")])
def test_served_native_requests_equal_offline_target_only(q41_bundle, speculation, backend):
    import httpx

    with specdec.load(q41_bundle, backend="onnxruntime") as offline:
        expected = [offline.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).text
                    for prompt in PROMPTS]
    with start(q41_bundle, backend=backend, speculation=speculation) as server, \
            ThreadPoolExecutor(len(PROMPTS)) as pool:
        api = client(server, key="unused")
        got = list(pool.map(lambda prompt: api.completions.create(model="q41", prompt=prompt, max_tokens=NEW_TOKENS,
                                                                    temperature=0).choices[0].text, PROMPTS))
        exposition = httpx.get(f"{server.url}/metrics").text
    assert got == expected
    assert metric(exposition, "specdec_round_rows_sum") / metric(exposition, "specdec_round_rows_count") > 1.5
    if speculation == "fixed":  # adaptive may measure that speculation does not pay here, and stop
        assert metric(exposition, "specdec_draft_tokens_accepted_total") > 0  # the native draft drafted, and was right


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="backend 'gpu' is unknown") as caught:
        ServeOptions(bundle="b", backend="gpu")
    assert "onnxruntime, native" in caught.value.hint
