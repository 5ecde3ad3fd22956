"""The head's products on the native kernels (specdec.native: specdec_matmul): the head's weights quantized to Q8_0
blocks (specdec.blocks.BLOCK8) once, when the head opens, times the activations as the target takes its own: fp32
(the step kernel), or, beside a target of int8 activations, each row rounded to int8 per block (the Q8A kernel,
VPDPBUSD: a chain step about a sixth cheaper). A head step reads a little over one byte a weight, the LM head over
the draft vocabulary most of them.

The blocks compute another function than the fp32 weights (each weight rounded to its block's 8-bit grid); the head
only proposes, and acceptance compares the target with the q the head really used, so exactness does not depend on
it. `dequantized()` gives the reference products of the same blocks (tests compare the two paths with it).
"""
from __future__ import annotations

import threading

import numpy as np

from specdec.blocks import BLOCK, q8_blocks, q8_rows
from specdec.head.model import FloatProducts
from specdec.native.model import KERNELS, WEIGHT_KINDS, Scratch, raise_for
from specdec.weight_kinds import Kernel

STEP = KERNELS[Kernel.STEP]
Q8A = KERNELS[Kernel.Q8A]
Q8A_REF = KERNELS[Kernel.Q8A_REF]  # Q8A in plain C: the same bits


def blocks_fit(matrices: dict) -> bool:
    """Whether every product's K is a whole number of blocks (else the head keeps the fp32 products)."""
    return all(matrix.shape[1] % BLOCK == 0 for matrix in matrices.values())


class BlockProducts:
    """x @ W.T through the kernels over Q8_0 blocks of each W. kernels: the loaded library (load_kernels);
    threads: the kernels' worker count; kernel: STEP (fp32 activations), Q8A or Q8A_REF (int8 activations)."""

    def __init__(self, matrices: dict, kernels, threads: int, kernel: int = STEP):
        self.blocks = {name: q8_blocks(matrix)[0] for name, matrix in matrices.items()}  # [N, K / 32] of BLOCK8
        self.kernels = kernels
        self.threads = threads
        self.kernel = kernel
        self.scratch = Scratch()
        self._needs = {}  # (M, K) -> scratch bytes
        self._lock = threading.Lock()  # one product at a time: the scratch is this object's

    def __call__(self, name: str, x: np.ndarray) -> np.ndarray:
        # x: [M, K] float32 -> [M, N]
        blocks = self.blocks[name]
        rows, width = x.shape
        y = np.empty((rows, len(blocks)), np.float32)
        need = self._needs.get((rows, width))
        if need is None:
            need = self._needs[(rows, width)] = self.kernels.specdec_matmul_scratch_bytes(rows, width, self.kernel,
                                                                                         self.threads)
        with self._lock:
            address, size = self.scratch.at_least(need)
            raise_for(self.kernels.specdec_matmul(
                x.ctypes.data, rows, width, blocks.ctypes.data, blocks.shape[1], WEIGHT_KINDS[blocks.dtype],
                self.kernel, y.ctypes.data, len(blocks), address, size, self.threads),
                f"the head's {name} product of {[rows, width]} by blocks {list(blocks.shape)}")
        return y

    def dequantized(self) -> FloatProducts:
        """The fp32 reference products of these very blocks (d·q per weight), fp32 activations."""
        return FloatProducts({name: q8_rows(blocks) for name, blocks in self.blocks.items()})
