"""On a GPU (skipped without one and CuPy): kernels.cu against its numpy references on the same inputs, and the cuda
backend's greedy output of every drafter, with graphs and without, identical to plain decoding on the same GPU and to
onnxruntime's on the CPU. benchmarks/cuda_check.py runs these checks and more in one timed run."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specdec.runtime import GenerationConfig, load
from specdec.runtime.cuda_backend import CudaOptions
from specdec.runtime.generator import load_cuda
from specdec.runtime.registry import gpu_visible

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_visible(), reason="needs an NVIDIA GPU and CuPy")]
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def _check_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_check.py"
    spec = importlib.util.spec_from_file_location("cuda_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kernel_matches_its_reference():
    from specdec.cuda.device import CupyKernels
    from specdec.cuda.reference import ReferenceKernels

    check = _check_module()
    errors = check.kernel_parity(CupyKernels(0, few_rows=16), ReferenceKernels(16), check.SMALL)
    assert max(errors.values()) <= check.KERNEL_TOLERANCE, errors


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_on_the_gpu_equals_plain_and_onnxruntime(q41_pair, graphs):
    with load(q41_pair, backend="onnxruntime") as ort:
        want = ort.generate(PROMPT, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
    with load_cuda(q41_pair, CudaOptions(graphs=graphs)) as gen:
        for drafter in ("none", "prompt_lookup", "model", "auto"):
            assert gen.generate(PROMPT, GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=4)).token_ids == want
