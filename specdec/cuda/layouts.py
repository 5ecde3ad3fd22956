"""The weight kinds the cuda kernels read (specdec.weight_kinds' table, less UNSERVED), and where a native weights
array belongs among them. kernels.cu lists the kinds it serves (CUDA_KINDS) and names its product and dequant kernels
after them; UNSERVED is the one place that says which of the table's kinds it does not serve, and why
(tests/cuda/test_kernels.py checks that the two cover the table)."""
from __future__ import annotations

import numpy as np

from specdec.weight_kinds import WeightKind, kind_of

UNSERVED = {WeightKind.Q5: "a K-quant GGUF's 5-bit blocks (the mixed layout): no decode in kernels.cu yet",
            WeightKind.Q6: "a Q6_K's blocks of a scale per 16 (the mixed layout): no decode in kernels.cu yet"}
SERVED = tuple(kind for kind in WeightKind if kind not in UNSERVED)  # kernels.cu's CUDA_KINDS


def layout_of(array: np.ndarray) -> WeightKind:
    """The weight kind of a native weights array, one the cuda kernels serve; TypeError otherwise."""
    kind = kind_of(array)
    if kind in UNSERVED:
        raise TypeError(f"the cuda kernels do not read {kind.label} weights: {UNSERVED[kind]}")
    return kind


def inputs(kind: WeightKind, array: np.ndarray) -> int:
    """K: the inputs of a column of `array` (the draft's pairs may end in a half-empty pair: its K is the target's,
    which the caller passes where it matters)."""
    return array.shape[1] * kind.per
