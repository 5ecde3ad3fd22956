"""The tiny bundles of the cuda backend's tests, and its models opened on the numpy reference kernels (the CPU
stand-in for kernels.cu: it runs specdec's orchestration, never the GPU's code)."""
from __future__ import annotations

import pytest

from benchmarks.gpu_bundles import tiny_pair
from specdec.cuda.reference import ReferenceKernels
from specdec.runtime.cuda_backend import CudaOptions
from specdec.runtime.generator import load_cuda


@pytest.fixture(scope="session")
def q41_pair(tmp_path_factory):
    """A tiny LLaMA on the GGUF grids (Q4_1 blocks, a Q8_0 head) with its int4-q41 draft, head trimmed."""
    return tiny_pair(tmp_path_factory.mktemp("q41"), "q41")


@pytest.fixture(scope="session")
def bf16_pair(tmp_path_factory):
    """A bf16 tiny LLaMA (native bf16 rows) with its int4-q41 draft."""
    return tiny_pair(tmp_path_factory.mktemp("bf16"), "bf16")


@pytest.fixture(scope="session")
def q80_pair(tmp_path_factory):
    """A tiny LLaMA on Q8_0 grids throughout (a Q8_0 GGUF's layout) with its int4-q41 draft."""
    return tiny_pair(tmp_path_factory.mktemp("q80"), "q80")


def reference(bundle, graphs: bool = True):
    """load(bundle, backend="cuda") with the numpy reference kernels in the GPU's place."""
    return load_cuda(bundle, CudaOptions(kernels=ReferenceKernels, graphs=graphs))
