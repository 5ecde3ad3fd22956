"""`specdec serve` on the cuda backend (its engine and HTTP app around a generator on the numpy reference kernels):
concurrent requests share calls (continuous batching over the device's KV slots) and give onnxruntime's offline
target-only greedy text; and the CLI's refusal of backend cuda on a machine without CuPy or a GPU."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec import GenerationConfig
from specdec.cuda.reference import ReferenceKernels
from specdec.runtime import load
from specdec.runtime.cuda_backend import CudaOptions
from specdec.runtime.generator import load_cuda
from specdec.runtime.registry import gpu_visible

pytest.importorskip("fastapi")

from specdec.serving.app import build_app  # noqa: E402
from specdec.serving.engine import Engine  # noqa: E402
from specdec.serving.options import ServeOptions  # noqa: E402
from specdec.serving.server import BackgroundServer  # noqa: E402
from tests.serving.conftest import client, metric  # noqa: E402
from tests.serving.test_serve_exactness import NEW_TOKENS, PROMPTS  # noqa: E402


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
def test_served_cuda_requests_equal_offline_target_only(q41_pair, speculation):
    import httpx

    with load(q41_pair, backend="onnxruntime") as offline:
        expected = [offline.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).text
                    for prompt in PROMPTS]
    options = ServeOptions(bundle=str(q41_pair), port=0, backend="cuda", speculation=speculation)
    engine = Engine(load_cuda(q41_pair, CudaOptions(kernels=ReferenceKernels)), options).start()
    try:
        with BackgroundServer(options, app=build_app(options, engine)) as server, \
                ThreadPoolExecutor(len(PROMPTS)) as pool:
            api = client(server, key="unused")
            got = list(pool.map(lambda p: api.completions.create(model="q41", prompt=p, max_tokens=NEW_TOKENS,
                                                                 temperature=0).choices[0].text, PROMPTS))
            exposition = httpx.get(f"{server.url}/metrics").text
    finally:
        engine.close()
    assert got == expected
    assert metric(exposition, "specdec_round_rows_sum") / metric(exposition, "specdec_round_rows_count") > 1.5
    if speculation == "fixed":
        assert metric(exposition, "specdec_draft_tokens_accepted_total") > 0  # the cuda draft drafted, and was right


@pytest.mark.skipif(gpu_visible(), reason="this machine has a GPU")
def test_the_cli_refuses_backend_cuda_without_a_gpu(q41_pair):
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", str(q41_pair), "--prompt", "Hi",
                           "--backend", "cuda", "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert ("needs CuPy" in done.stderr and "specdec[cuda]" in done.stderr) or "found no CUDA GPU" in done.stderr
    assert "Hint:" in done.stderr
