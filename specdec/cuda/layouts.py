"""The weight layouts the cuda kernels read, as objects (kernels.cu's enum), and where a native weights array
(specdec.blocks' dtypes) belongs among them."""
from __future__ import annotations

import enum

import numpy as np

from specdec.blocks import BF16, BLOCK, BLOCK4, BLOCK4P, BLOCK8


class Layout(enum.IntEnum):
    """A weight's layout; the value is kernels.cu's code, the suffix its product and dequant kernels' names."""

    Q4_1 = 0  # blocks of 32: w = d * q + m
    Q8_0 = 1  # blocks of 32: w = d * q
    Q4_1_PAIRS = 2  # the int4-q41 draft's two Q4_1 blocks with fp16 scales
    BF16 = 3  # rows [N, K]
    F16 = 4
    F32 = 5

    @property
    def suffix(self) -> str:
        return {0: "q41", 1: "q80", 2: "q41p", 3: "bf16", 4: "f16", 5: "f32"}[self.value]

    @property
    def blocks(self) -> bool:
        """Whether an array of this layout is [N, blocks] rather than rows [N, K]."""
        return self in (Layout.Q4_1, Layout.Q8_0, Layout.Q4_1_PAIRS)

    def inputs(self, array: np.ndarray) -> int:
        """K: the inputs of a column of `array` (the draft's pairs may end in a half-empty pair: its K is the
        target's, which the caller passes where it matters)."""
        per = 2 * BLOCK if self is Layout.Q4_1_PAIRS else BLOCK if self.blocks else 1
        return array.shape[1] * per


DTYPE_LAYOUTS = {BLOCK4: Layout.Q4_1, BLOCK8: Layout.Q8_0, BLOCK4P: Layout.Q4_1_PAIRS, BF16: Layout.BF16,
                 np.dtype("<f2"): Layout.F16, np.dtype("<f4"): Layout.F32}


def layout_of(array: np.ndarray) -> Layout:
    try:
        return DTYPE_LAYOUTS[array.dtype]
    except KeyError:
        raise TypeError(f"no cuda layout for dtype {array.dtype}") from None
